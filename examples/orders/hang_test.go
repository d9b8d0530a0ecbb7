package main

import (
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgconn/pgconntest"
)

// A database that accepts connections and never answers: the demo and
// the services fail after connect_timeout saying so, and stop within a
// second of SIGINT or SIGTERM saying what they were waiting for.
func TestSilentDatabase(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	commands := [][]string{
		{"demo", "-transport", "gochannel"},
		{"serve", "-transport", "gochannel", "relay"},
	}
	for _, args := range commands {
		name := args[0]
		t.Run(name+"/connect_timeout", func(t *testing.T) {
			t.Parallel()
			srv := pgconntest.Silent(t)
			start := time.Now()
			p := pgconntest.Start(t, bin, nil, append(args, "-database-url", srv.URL("connect_timeout=1"))...)
			ended, code, out, ok := p.Wait(10 * time.Second)
			require.True(t, ok, "still running after 10s:\n%s", out)
			require.Equal(t, 1, code, out)
			require.Positive(t, srv.Accepted(), "the fault: the server accepted")
			require.Less(t, ended.Sub(start), 4*time.Second, out)
			require.Contains(t, out, "orders: creating schema millwright_orders")
			require.Contains(t, out, "postgres at "+srv.Addr()+" accepted the connection but did not answer within 1s (connect_timeout")
		})
		for _, sig := range []syscall.Signal{syscall.SIGINT, syscall.SIGTERM} {
			t.Run(name+"/"+sig.String(), func(t *testing.T) {
				t.Parallel()
				srv := pgconntest.Silent(t)
				p := pgconntest.Start(t, bin, nil, append(args, "-database-url", srv.URL(""))...)
				p.AwaitAccepted(t, srv, 10*time.Second)
				sent := p.Signal(t, sig)
				ended, code, out, ok := p.Wait(5 * time.Second)
				require.True(t, ok, "still running 5s after %s:\n%s", sig, out)
				require.Less(t, ended.Sub(sent), time.Second, out)
				require.Equal(t, 1, code, out)
				require.Contains(t, out, "interrupted while connecting to postgres at "+srv.Addr()+" (", out)
				require.Contains(t, out, fmt.Sprintf("%v signal received", sig), out)
				require.True(t, strings.HasPrefix(out, "orders: "), out)
			})
		}
	}
}
