package cli

import (
	"fmt"
	"os"
	"strings"

	"github.com/spf13/cobra"
)

// The Postgres driver of the components a command runs (--driver).
const (
	EnvDriver = "MILLWRIGHT_DATABASE_DRIVER"
	DriverPQ  = "pq"
	DriverPgx = "pgx"
	// DefaultDriver: the components run on pgxpool (issue 32).
	DefaultDriver = DriverPgx
)

// AddDriverFlag adds --driver, persistent, to cmd, saying what runs on it
// (usage ends the flag's description).
func AddDriverFlag(cmd *cobra.Command, usage string) {
	cmd.PersistentFlags().String("driver", "", "Postgres driver: pgx (a pgxpool.Pool) or pq (database/sql on lib/pq); default $"+EnvDriver+", else "+DefaultDriver+". "+usage)
}

// DriverOf returns the driver the command uses: --driver, else
// $MILLWRIGHT_DATABASE_DRIVER, else pgx.
func DriverOf(cmd *cobra.Command) (string, error) { return DriverFrom(cmd, os.LookupEnv) }

// DriverFrom is DriverOf with the environment read through lookup.
func DriverFrom(cmd *cobra.Command, lookup func(string) (string, bool)) (string, error) {
	d, from := "", "--driver"
	if f := cmd.Flags().Lookup("driver"); f != nil && f.Changed {
		d = f.Value.String()
	} else if v, ok := lookup(EnvDriver); ok {
		d, from = v, "$"+EnvDriver
	}
	switch d = strings.ToLower(strings.TrimSpace(d)); d {
	case "":
		return DefaultDriver, nil
	case DriverPQ, DriverPgx:
		return d, nil
	}
	return "", fmt.Errorf("driver %q (%s): want pgx or pq", d, from)
}
