//go:build linux

package cli

import (
	"os"

	"golang.org/x/sys/unix"
)

// FileIsTerminal reports whether f is a terminal. /dev/null is a character
// device too, so the mode bits are not enough: ask for terminal attributes.
func FileIsTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}
