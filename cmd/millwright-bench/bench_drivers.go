package main

import (
	"os"

	"github.com/millwright/millwright/internal/cli"
	"github.com/spf13/cobra"
)

// benchDrivers returns the Postgres drivers a bench measures on, side by
// side in the same run: the one --driver (or $MILLWRIGHT_DATABASE_DRIVER)
// names, else both, pq first.
func benchDrivers(cmd *cobra.Command) ([]string, error) {
	f := cmd.Flags().Lookup("driver")
	if _, env := os.LookupEnv(cli.EnvDriver); (f == nil || !f.Changed) && !env {
		return []string{cli.DriverPQ, cli.DriverPgx}, nil
	}
	d, err := cli.DriverOf(cmd)
	if err != nil {
		return nil, err
	}
	return []string{d}, nil
}
