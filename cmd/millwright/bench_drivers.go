package main

import (
	"fmt"

	"github.com/spf13/cobra"
)

// addBenchDriversFlag adds --driver to a bench command: the drivers its
// Postgres figures are measured on, side by side in the same run.
func addBenchDriversFlag(cmd *cobra.Command) {
	cmd.Flags().StringSlice("driver", []string{"pq", "pgx"}, "Postgres drivers to measure on, in the same run: pq (lib/pq, database/sql), pgx (pgxpool)")
}

// benchDrivers returns the --driver values, checked.
func benchDrivers(cmd *cobra.Command) ([]string, error) {
	ds, err := cmd.Flags().GetStringSlice("driver")
	if err != nil {
		return nil, err
	}
	if len(ds) == 0 {
		return nil, fmt.Errorf("%s: --driver is empty: want pq, pgx or both", cmd.CommandPath())
	}
	for _, d := range ds {
		if d != "pq" && d != "pgx" {
			return nil, fmt.Errorf("%s: --driver %q: want pq or pgx", cmd.CommandPath(), d)
		}
	}
	return ds, nil
}
