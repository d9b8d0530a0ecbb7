package main

import (
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
)

// A database that accepts connections and never answers: every command
// that connects, on either driver, fails after connect_timeout saying so, and stops on
// SIGINT or SIGTERM saying what it was waiting for. The real
// binary runs, so main's signal handling is what is tested.
func TestSilentDatabase(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	commands := [][]string{
		{"outbox", "status"},
		{"migrate"},
		{"dlq", "list"},
		{"saga", "list"},
		{"idempotency", "stats"},
		{"audit", "list"},
		{"outbox", "retry-failed", "--yes"},
		// The default driver is pgx: the same on lib/pq.
		{"outbox", "status", "--driver", "pq"},
		{"outbox", "retry-failed", "--yes", "--driver", "pq"},
	}

	t.Run("connect_timeout", func(t *testing.T) {
		t.Parallel()
		for _, args := range commands {
			t.Run(strings.Join(args, "_"), func(t *testing.T) {
				t.Parallel()
				out := pgconntest.RequireGivesUpOnSilentServer(t, bin, withURL(args))
				require.True(t, strings.HasPrefix(out, "millwright: connecting to database postgres://u:xxxxx@"), out)
				require.NotContains(t, out, "hunter2")
			})
		}
	})

	// A signal ends the wait for a silent server (connect_timeout=120, so
	// only the signal can end it within the test).
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			for _, args := range commands {
				t.Run(strings.Join(args, "_"), func(t *testing.T) {
					t.Parallel()
					pgconntest.RequireStopsOnSignal(t, bin, sig, withURL(args))
				})
			}
		})
	}
}

// withURL appends --database-url to a command's arguments.
func withURL(args []string) func(string) []string {
	return func(u string) []string { return append(append([]string(nil), args...), "--database-url", u) }
}

// A refused port fails at once, saying "refused", not "did not answer":
// with connect_timeout=120 in the URL, a CLI that kept retrying the
// refused port until connect_timeout would still be running when the
// 60 s bound ends the wait. (Before, it had to exit within a second of
// its own start, which a loaded machine's process start can exceed.)
func TestRefusedDatabaseFailsAtOnce(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	addr := pgconntest.Refused(t)
	p := pgconntest.Start(t, bin, nil, "outbox", "status", "--database-url", "postgres://u:hunter2@"+addr+"/db?sslmode=disable&connect_timeout=120")
	_, code, out, ok := p.Wait(60 * time.Second)
	require.True(t, ok, "still running 60s after its start, connect_timeout 120s: the refused port was retried\n%s", out)
	require.Equal(t, 1, code)
	require.Contains(t, out, "postgres at "+addr+" refused the connection after ")
	require.NotContains(t, out, "did not answer")
}

// Errors that already name the command are not prefixed again
// ("millwright: millwright outbox retry-failed: ...").
func TestErrorLineHasOnePrefix(t *testing.T) {
	t.Parallel()
	require.Equal(t, "millwright: boom", errorLine(errors.New("boom")))
	require.Equal(t, "millwright outbox retry-failed: not confirmed", errorLine(errors.New("millwright outbox retry-failed: not confirmed")))

	bin := pgconntest.Build(t, ".")
	p := pgconntest.Start(t, bin, nil, "outbox", "retry-failed")
	_, code, out, ok := p.Wait(10 * time.Second)
	require.True(t, ok, out)
	require.Equal(t, 1, code)
	require.True(t, strings.HasPrefix(out, "millwright outbox retry-failed: stdin is not a terminal"), out)
	require.NotContains(t, out, "millwright: millwright")
}
