package main

import (
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
)

// The demo prints one summary line counted from the database, on each
// driver (-driver pgx, the default, and -driver pq).
func TestDemo(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		schema := pgtest.New(t) // migrations are applied by the demo itself
		var out strings.Builder
		err := demo([]string{"-database-url", pgtest.BaseURL(), "-schema", schema.Name, "-transport", "gochannel", "-driver", driver,
			"-orders", "12", "-fail-payment-every", "4", "-fail-shipping-every", "5"}, &out)
		require.NoError(t, err)
		// Orders 4, 8 and 12 fail payment, 5 and 10 fail shipping.
		require.Equal(t, "orders=12 completed=7 compensated=5 dlq=1 lost=0 duplicate_effects=0 broken_compensations=0\n", out.String())
	})
}

func TestDemoRejectsUnknownDriver(t *testing.T) {
	t.Parallel()
	err := demo([]string{"-database-url", pgtest.BaseURL(), "-driver", "libpq", "-transport", "gochannel"}, &strings.Builder{})
	require.ErrorContains(t, err, `-driver "libpq" (or MILLWRIGHT_DATABASE_DRIVER): want pgx or pq`)
}

func TestServeRejectsUnknownService(t *testing.T) {
	t.Parallel()
	err := serve([]string{"billing", "-log", "error", "shipment"})
	require.ErrorContains(t, err, `unknown service "shipment"`)
}

// A -schema with capital letters names the schema Postgres folds it to:
// before, the example created "Name" (quoted) and then looked for name
// through the unquoted search_path, and every statement failed with "no
// schema has been selected to create in".
func TestDemoMixedCaseSchema(t *testing.T) {
	t.Parallel()
	admin := pgtest.New(t).DB
	name := "Orders_" + strings.ToUpper(watermill.NewShortUUID())
	t.Cleanup(func() {
		_, _ = admin.Exec(`DROP SCHEMA IF EXISTS ` + strings.ToLower(name) + ` CASCADE`)
		_, _ = admin.Exec(`DROP SCHEMA IF EXISTS "` + name + `" CASCADE`)
	})
	var out strings.Builder
	err := demo([]string{"-database-url", pgtest.BaseURL(), "-schema", name, "-transport", "gochannel",
		"-orders", "2"}, &out)
	require.NoError(t, err)
	require.Equal(t, "orders=2 completed=2 compensated=0 dlq=1 lost=0 duplicate_effects=0 broken_compensations=0\n", out.String())
}

func TestDemoRejectsSchemaNeedingQuotes(t *testing.T) {
	t.Parallel()
	err := demo([]string{"-database-url", pgtest.BaseURL(), "-schema", `a"b`, "-transport", "gochannel"}, &strings.Builder{})
	require.ErrorContains(t, err, `-schema "a\"b"`)
	require.ErrorContains(t, err, "plain Postgres identifier")
}

// Every phase of a connection to the example's HTTP servers is bounded.
func TestHTTPServerBoundsEveryPhase(t *testing.T) {
	t.Parallel()
	srv := newHTTPServer("127.0.0.1:0", nil)
	require.Positive(t, srv.ReadHeaderTimeout)
	require.Positive(t, srv.ReadTimeout)
	require.Positive(t, srv.WriteTimeout)
	require.Positive(t, srv.IdleTimeout)
	require.Positive(t, srv.MaxHeaderBytes)
}
