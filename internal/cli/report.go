package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/cli/progress"
)

// Terminal is implemented by a reader or writer that reports whether it
// is a terminal; tests use it to stand in for one.
type Terminal interface{ IsTerminal() bool }

// WriterIsTerminal reports whether w is a terminal (a Terminal, or an
// *os.File FileIsTerminal says is one).
func WriterIsTerminal(w io.Writer) bool {
	if t, ok := w.(Terminal); ok {
		return t.IsTerminal()
	}
	f, ok := w.(*os.File)
	return ok && FileIsTerminal(f)
}

// NewProgress starts the progress reporter of a long operation of cmd:
// on stderr, redrawn in place when stderr is a terminal, one line per
// interval otherwise.
//
// On a terminal the command's stdout and stderr are wrapped so that what
// the command prints meanwhile clears the progress line first: writers
// taken from cmd before NewProgress are not, so take them after.
func NewProgress(cmd *cobra.Command, what, unit string, total int64) *progress.Reporter {
	errOut := cmd.ErrOrStderr()
	p := progress.New(progress.Config{Out: errOut, What: what, Unit: unit, Total: total, Terminal: WriterIsTerminal(errOut)})
	if WriterIsTerminal(errOut) {
		cmd.SetOut(p.Wrap(cmd.OutOrStdout()))
		cmd.SetErr(p.Wrap(errOut))
	}
	return p
}

// StoppedBy is why an operation stopped: err, prefixed with the cause of
// ctx's end (the signal: "interrupt signal received") unless err says it,
// or that cause alone when err is nil.
func StoppedBy(ctx context.Context, err error) error {
	if ctx.Err() == nil {
		return err
	}
	cause := context.Cause(ctx)
	switch {
	case err == nil:
		return cause
	case strings.Contains(err.Error(), cause.Error()):
		return err
	}
	return fmt.Errorf("%v: %w", cause, err)
}
