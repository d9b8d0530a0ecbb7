package main

import (
	"context"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
)

func driverCmd(t *testing.T, args ...string) *cobra.Command {
	t.Helper()
	cmd := &cobra.Command{Use: "x", RunE: func(*cobra.Command, []string) error { return nil }}
	addDriverFlag(cmd)
	addDatabaseFlag(cmd)
	cmd.SetArgs(args)
	require.NoError(t, cmd.ExecuteContext(context.Background()))
	return cmd
}

func TestDriverFromFlagEnvOrDefault(t *testing.T) {
	t.Parallel()
	env := func(v string) func(string) (string, bool) {
		return func(k string) (string, bool) { return v, k == envDriver && v != "" }
	}
	for _, tc := range []struct {
		args []string
		env  string
		want string
	}{
		{nil, "", driverPgx},
		{nil, "pq", driverPQ},
		{nil, " PGX ", driverPgx},
		{[]string{"--driver", "pq"}, "pgx", driverPQ},
		{[]string{"--driver=pgx"}, "pq", driverPgx},
	} {
		got, err := driverFrom(driverCmd(t, tc.args...), env(tc.env))
		require.NoError(t, err, "%v %q", tc.args, tc.env)
		require.Equal(t, tc.want, got, "%v %q", tc.args, tc.env)
	}
	_, err := driverFrom(driverCmd(t, "--driver", "mysql"), env(""))
	require.ErrorContains(t, err, `driver "mysql" (--driver): want pgx or pq`)
	_, err = driverFrom(driverCmd(t), env("libpq"))
	require.ErrorContains(t, err, `driver "libpq" ($MILLWRIGHT_DATABASE_DRIVER): want pgx or pq`)
}

// openPool opens one pool, of --driver's kind, on the URL's schema.
func TestOpenPoolOfEachDriver(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx := context.Background()
	p, err := openPool(driverCmd(t, "--driver", "pq", "--database-url", s.URL))
	require.NoError(t, err)
	require.NotNil(t, p.sql, "pq: a *sql.DB")
	require.Nil(t, p.pgx, "pq: no pgx pool beside it")
	require.Equal(t, p.sql, p.handle().SQL())
	var schema string
	require.NoError(t, p.sql.QueryRowContext(ctx, `SELECT current_schema()`).Scan(&schema))
	require.Equal(t, s.Name, schema, "on the URL's schema")
	p.Close()

	p, err = openPool(driverCmd(t, "--driver", "pgx", "--database-url", s.URL))
	require.NoError(t, err)
	defer p.Close()
	require.NotNil(t, p.pgx, "pgx: a *pgxpool.Pool")
	require.Nil(t, p.sql, "pgx: no *sql.DB beside it")
	require.Equal(t, p.pgx, p.handle().Pgx())
	require.NoError(t, p.pgx.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema))
	require.Equal(t, s.Name, schema, "on the URL's schema")

	_, err = openPool(driverCmd(t, "--driver", "pgx", "--database-url", "postgres://u:hunter2@127.0.0.1:1/x?sslmode=disable&connect_timeout=2"))
	require.ErrorContains(t, err, "connecting to database postgres://u:xxxxx@127.0.0.1:1/x")
	require.ErrorContains(t, err, "postgres at 127.0.0.1:1 refused the connection after ")
	require.NotContains(t, err.Error(), "hunter2")
}

// `outbox clean` deletes the same rows with either driver.
func TestCleanOnEveryDriver(t *testing.T) {
	t.Parallel()
	for _, d := range []string{driverPQ, driverPgx} {
		t.Run(d, func(t *testing.T) {
			t.Parallel()
			s := pgtest.New(t, outbox.Migrations(), audit.Migrations())
			_, err := s.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, published_at)
				SELECT 'e-' || g, 't', 'a', '{}', 'published', now() - make_interval(days => CASE WHEN g < 3 THEN 8 ELSE 0 END)
				FROM generate_series(1, 3) g`)
			require.NoError(t, err)
			cmd := cleanCmd("outbox")
			addDriverFlag(cmd)
			out, _, err := runCLI(t, cmd, nil, s.URL, "--yes", "--driver", d)
			require.NoError(t, err)
			require.Contains(t, out, "deleted 2 published outbox events in 1 batches")
			var n int
			require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_outbox`).Scan(&n))
			require.Equal(t, 1, n)
		})
	}
	s := pgtest.New(t, outbox.Migrations(), audit.Migrations())
	cmd := cleanCmd("outbox")
	addDriverFlag(cmd)
	_, _, err := runCLI(t, cmd, nil, s.URL, "--yes", "--driver", "sqlite")
	require.ErrorContains(t, err, "want pgx or pq")
	var audited int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_audit`).Scan(&audited))
	require.Zero(t, audited, "a run refused for its driver writes nothing")
}
