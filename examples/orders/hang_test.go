package main

import (
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
)

// A database that accepts connections and never answers: the demo and
// the services fail after connect_timeout saying so, and stop on a
// signal (SIGINT or SIGTERM) saying what they were waiting for.
func TestSilentDatabase(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	commands := [][]string{
		{"demo", "-transport", "gochannel"},
		{"serve", "-transport", "gochannel", "relay"},
	}
	for _, args := range commands {
		name := args[0]
		withURL := func(u string) []string { return append(append([]string(nil), args...), "-database-url", u) }
		t.Run(name+"/connect_timeout", func(t *testing.T) {
			t.Parallel()
			out := pgconntest.RequireGivesUpOnSilentServer(t, bin, withURL)
			require.Contains(t, out, "orders: creating schema millwright_orders")
		})
		for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
			t.Run(name+"/"+sig.String(), func(t *testing.T) {
				t.Parallel()
				out := pgconntest.RequireStopsOnSignal(t, bin, sig, withURL)
				require.True(t, strings.HasPrefix(out, "orders: "), out)
			})
		}
	}
}
