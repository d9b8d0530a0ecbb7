package main

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn/pgconntest"
)

// A database that accepts connections and never answers: every command
// that connects fails after connect_timeout saying so, and stops within a
// second of SIGINT or SIGTERM saying what it was waiting for. The real
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
	}

	t.Run("connect_timeout", func(t *testing.T) {
		t.Parallel()
		for _, args := range commands {
			t.Run(strings.Join(args, "_"), func(t *testing.T) {
				t.Parallel()
				srv := pgconntest.Silent(t)
				start := time.Now()
				p := pgconntest.Start(t, bin, nil, append(args, "--database-url", srv.URL("connect_timeout=1"))...)
				ended, code, out, ok := p.Wait(10 * time.Second)
				require.True(t, ok, "still running after 10s:\n%s", out)
				require.Equal(t, 1, code, out)
				require.Positive(t, srv.Accepted(), "the fault: the server accepted")
				require.Less(t, ended.Sub(start), 4*time.Second, out)
				require.Contains(t, out, "postgres at "+srv.Addr()+" accepted the connection but did not answer within 1s (connect_timeout")
				require.True(t, strings.HasPrefix(out, "millwright: connecting to database postgres://u:xxxxx@"), out)
				require.NotContains(t, out, "hunter2")
			})
		}
	})

	// Without connect_timeout the default (10s) applies; a signal ends the
	// wait at once.
	for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			for _, args := range commands {
				t.Run(strings.Join(args, "_"), func(t *testing.T) {
					t.Parallel()
					srv := pgconntest.Silent(t)
					p := pgconntest.Start(t, bin, nil, append(args, "--database-url", srv.URL(""))...)
					p.AwaitAccepted(t, srv, 10*time.Second)
					sent := p.Signal(t, sig)
					ended, code, out, ok := p.Wait(5 * time.Second)
					require.True(t, ok, "still running 5s after %s:\n%s", sig, out)
					require.Less(t, ended.Sub(sent), time.Second, out)
					require.Equal(t, 1, code, out)
					require.Contains(t, out, "interrupted while connecting to postgres at "+srv.Addr()+" (", out)
					require.Contains(t, out, signalCause(sig), out)
				})
			}
		})
	}
}

// signalCause is how signal.NotifyContext's cause names sig.
func signalCause(sig os.Signal) string { return fmt.Sprintf("%v signal received", sig) }

// A refused port fails at once, saying "refused", not "did not answer".
func TestRefusedDatabaseFailsAtOnce(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	addr := pgconntest.Refused(t)
	start := time.Now()
	p := pgconntest.Start(t, bin, nil, "outbox", "status", "--database-url", "postgres://u:hunter2@"+addr+"/db?sslmode=disable")
	ended, code, out, ok := p.Wait(10 * time.Second)
	require.True(t, ok, out)
	require.Equal(t, 1, code)
	require.Less(t, ended.Sub(start), time.Second, out)
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
