package cli_test

import (
	"context"
	"errors"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/cli"
)

func TestDatabaseURLFlagThenEnvThenDefault(t *testing.T) { // not parallel: Setenv
	t.Setenv("MILLWRIGHT_DATABASE_URL", "")
	require.Equal(t, cli.DefaultDatabaseURL, cli.DatabaseURL(""))
	t.Setenv("MILLWRIGHT_DATABASE_URL", "postgres://env/db")
	require.Equal(t, "postgres://env/db", cli.DatabaseURL(""))
	require.Equal(t, "postgres://flag/db", cli.DatabaseURL("postgres://flag/db"))
}

func TestWithDSNParamOnURLAndKeyValue(t *testing.T) {
	t.Parallel()
	require.Equal(t, "postgres://h/db?application_name=x&sslmode=disable",
		cli.WithDSNParam("postgres://h/db?sslmode=disable&application_name=old", "application_name", "x"))
	require.Equal(t, `host=h dbname=db application_name='it\'s \\ x'`,
		cli.WithDSNParam("host=h dbname=db", "application_name", `it's \ x`), "a key=value DSN gets the key last, quoted")
}

func TestDriverFromFlagEnvOrDefault(t *testing.T) {
	t.Parallel()
	cmd := &cobra.Command{Use: "x"}
	cli.AddDriverFlag(cmd, "what runs on it")
	none := func(string) (string, bool) { return "", false }
	d, err := cli.DriverFrom(cmd, none)
	require.NoError(t, err)
	require.Equal(t, cli.DefaultDriver, d)
	d, err = cli.DriverFrom(cmd, func(k string) (string, bool) { return " PQ ", k == cli.EnvDriver })
	require.NoError(t, err)
	require.Equal(t, cli.DriverPQ, d)
	require.NoError(t, cmd.ParseFlags([]string{"--driver", "mysql"}))
	_, err = cli.DriverFrom(cmd, none)
	require.EqualError(t, err, `driver "mysql" (--driver): want pgx or pq`)
}

func TestStoppedByNamesTheCause(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	require.Equal(t, boom, cli.StoppedBy(context.Background(), boom), "a live context: the error as it is")
	require.NoError(t, cli.StoppedBy(context.Background(), nil))

	cause := errors.New("interrupt signal received")
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(cause)
	require.Equal(t, cause, cli.StoppedBy(ctx, nil))
	err := cli.StoppedBy(ctx, boom)
	require.EqualError(t, err, "interrupt signal received: boom")
	require.ErrorIs(t, err, boom)
	already := errors.New("reading: interrupt signal received")
	require.Equal(t, already, cli.StoppedBy(ctx, already), "an error that says the cause is not prefixed again")
}
