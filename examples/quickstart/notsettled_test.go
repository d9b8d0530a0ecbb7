package main

import (
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport"
)

// A run that gives up (-timeout 1ms: the deadline also cuts the wait's
// own count short) prints the true counts, counted with a fresh context,
// and says "not settled"; it never prints a summary of zeros.
func TestGivesUpWithTrueCounts(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	schema := pgtest.New(t) // migrations are applied by the quickstart itself
	p := pgconntest.Start(t, bin, []string{transport.EnvTransport + "=", "MILLWRIGHT_DATABASE_DRIVER="}, "-database-url", schema.URL, "-timeout", "1ms")
	_, code, out, ok := p.Wait(60 * time.Second)
	require.True(t, ok, "still running after 60s:\n%s", out)
	t.Log(out)
	require.Equal(t, 1, code, out)
	require.Regexp(t, regexp.MustCompile(`(?m)^not settled after 1ms: driver=pgx transport=sql orders=20 published=\d+ effects=\d+ pending=\d+$`), out)
	require.Regexp(t, regexp.MustCompile(`(?m)^quickstart: orders not settled after 1ms: \d+ of 20 notified.*: context deadline exceeded$`), out)
	require.NotContains(t, out, "lost=")
}
