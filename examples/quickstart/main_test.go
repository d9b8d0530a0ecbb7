package main

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
)

// A database that accepts connections and never answers: the quickstart
// fails after connect_timeout saying so, and stops on SIGINT or SIGTERM
// saying what it was waiting for.
func TestSilentDatabase(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	withURL := func(u string) []string { return []string{"-database-url", u} }
	t.Run("connect_timeout", func(t *testing.T) {
		t.Parallel()
		out := pgconntest.RequireGivesUpOnSilentServer(t, bin, withURL)
		require.Contains(t, out, "quickstart: connecting (is Postgres running at --database-url?)")
	})
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			pgconntest.RequireStopsOnSignal(t, bin, sig, withURL)
		})
	}
}
