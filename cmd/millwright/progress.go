package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/cmd/millwright/internal/progress"
)

// newProgress starts the progress reporter of a long operation of cmd:
// on stderr, redrawn in place when stderr is a terminal, one line per
// interval otherwise (safety_tty_*.go's detection).
//
// On a terminal the command's stdout and stderr are wrapped so that what
// the command prints meanwhile clears the progress line first: writers
// taken from cmd before newProgress are not, so take them after.
func newProgress(cmd *cobra.Command, what, unit string, total int64) *progress.Reporter {
	errOut := cmd.ErrOrStderr()
	p := progress.New(progress.Config{Out: errOut, What: what, Unit: unit, Total: total, Terminal: writerIsTerminal(errOut)})
	if writerIsTerminal(errOut) {
		cmd.SetOut(p.Wrap(cmd.OutOrStdout()))
		cmd.SetErr(p.Wrap(errOut))
	}
	return p
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

// stoppedBy is why an operation stopped: err, prefixed with the cause of
// ctx's end (the signal: "interrupt signal received") unless err says it,
// or that cause alone when err is nil.
func stoppedBy(ctx context.Context, err error) error {
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

// benchProgress reports a benchmark's progress in runs: step is the
// bench's Step hook, end ends the report with the bench's error (or the
// command's cancellation) and returns that error.
func benchProgress(cmd *cobra.Command) (step func(done, total int), end func(error) error) {
	prog := newProgress(cmd, strings.TrimPrefix(cmd.CommandPath(), rootCmd.Name()+" "), "runs", 0)
	step = func(done, total int) {
		prog.SetTotal(int64(total))
		prog.Set(int64(done))
	}
	end = func(err error) error {
		// A bench may skip what fails and finish; after a signal that is
		// not a finished run.
		stopped := stoppedBy(cmd.Context(), err)
		if stopped != nil {
			prog.Stopped(stopped, "a benchmark keeps nothing between runs: re-running starts it over")
		} else {
			prog.Finish("")
		}
		return err
	}
	return step, end
}
