package main

import (
	"context"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/cli/progress"
)

// newProgress starts the progress reporter of a long operation of cmd
// (cli.NewProgress: take cmd's writers after it).
func newProgress(cmd *cobra.Command, what, unit string, total int64) *progress.Reporter {
	return cli.NewProgress(cmd, what, unit, total)
}

// stoppedBy is why an operation stopped (cli.StoppedBy).
func stoppedBy(ctx context.Context, err error) error { return cli.StoppedBy(ctx, err) }
