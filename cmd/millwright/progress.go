package main

import (
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright/internal/progress"
)

// newProgress starts the progress reporter of a long operation of cmd:
// on stderr, redrawn in place when stderr is a terminal, one line per
// interval otherwise (safety_tty_*.go's detection).
func newProgress(cmd *cobra.Command, what, unit string, total int64) *progress.Reporter {
	out := cmd.ErrOrStderr()
	return progress.New(progress.Config{Out: out, What: what, Unit: unit, Total: total, Terminal: writerIsTerminal(out)})
}

// writerIsTerminal reports whether w is a terminal (tests stand in for
// one with the terminal interface).
func writerIsTerminal(w io.Writer) bool {
	if t, ok := w.(terminal); ok {
		return t.IsTerminal()
	}
	f, ok := w.(*os.File)
	return ok && fileIsTerminal(f)
}
