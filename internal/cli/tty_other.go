//go:build !linux

package cli

import "os"

// FileIsTerminal reports whether f is a character device: a terminal, or
// (rarely, and then the prompt reads end of file and refuses) /dev/null.
func FileIsTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
