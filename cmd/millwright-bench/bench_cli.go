package main

import (
	"database/sql"

	"github.com/spf13/cobra"

	"github.com/millwright/millwright/internal/cli"
	"github.com/millwright/millwright/internal/pgconn"
)

// openDB opens the database of --database-url (the admin connection a
// bench makes its scratch schemas on), checked with a ping.
func openDB(cmd *cobra.Command) (*sql.DB, error) {
	u, _ := cmd.Flags().GetString("database-url")
	return cli.OpenDB(cmd.Context(), cli.DatabaseURL(u), pgconn.Open)
}

// benchProgress reports a benchmark's progress in runs: step is the
// bench's Step hook, end ends the report with the bench's error (or the
// command's cancellation) and returns that error.
func benchProgress(cmd *cobra.Command) (step func(done, total int), end func(error) error) {
	prog := cli.NewProgress(cmd, cmd.CommandPath(), "runs", 0)
	step = func(done, total int) {
		prog.SetTotal(int64(total))
		prog.Set(int64(done))
	}
	end = func(err error) error {
		// A bench may skip what fails and finish; after a signal that is
		// not a finished run.
		stopped := cli.StoppedBy(cmd.Context(), err)
		if stopped != nil {
			prog.Stopped(stopped, "a benchmark keeps nothing between runs: re-running starts it over")
		} else {
			prog.Finish("")
		}
		return err
	}
	return step, end
}

// addDriverFlag adds --driver, persistent, to the root: every bench
// measures on the driver it names.
func addDriverFlag(cmd *cobra.Command) {
	cli.AddDriverFlag(cmd, "The benchmarks measure on it (unset: on both, side by side); their scratch schemas use database/sql")
}
