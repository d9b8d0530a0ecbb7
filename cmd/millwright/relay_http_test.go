package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cmd/millwright/internal/relayenv"
	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/transport"
)

// shortHTTP are the HTTP bounds the tests below give the relay's server.
var shortHTTP = httpTimeouts{readHeader: time.Second, read: 2 * time.Second, write: 5 * time.Second, idle: time.Second}

// startRelayHTTP runs runRelay in process on a fresh schema with the
// gochannel transport and the given HTTP bounds, until the test ends. sub,
// when set, receives the transport's subscriber before the relays start.
func startRelayHTTP(t *testing.T, env map[string]string, timeouts httpTimeouts, sub func(message.Subscriber) error) (s *pgtest.Schema, addr string) {
	t.Helper()
	s = pgtest.New(t, outbox.Migrations())
	vars := map[string]string{relayenv.DatabaseURL: s.URL, relayenv.Addr: "127.0.0.1:0", relayenv.PollInterval: "50ms"}
	for k, v := range env {
		vars[k] = strings.ReplaceAll(v, "$URL", s.URL)
	}
	cfg, err := relayenv.Load(func(k string) (string, bool) { v, ok := vars[k]; return v, ok })
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan string, 1)
	done := make(chan error, 1)
	hooks := &relayHooks{ready: ready, httpTimeouts: &timeouts, transport: func(tr *transport.Transport) error {
		if sub == nil {
			return nil
		}
		s, err := tr.Subscriber("flood")
		if err != nil {
			return err
		}
		return sub(s)
	}}
	go func() { done <- runRelay(ctx, cfg, transport.Config{Kind: transport.GoChannel}, io.Discard, hooks) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("runRelay did not return within 30s")
		}
	})
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("runRelay: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("runRelay did not serve within 30s")
	}
	return s, addr
}

// closedWithin reads conn until the server closes it (EOF or reset) and
// reports whether it did within d, and after how long.
func closedWithin(t *testing.T, conn net.Conn, r io.Reader, d time.Duration) (bool, time.Duration) {
	t.Helper()
	start := time.Now()
	require.NoError(t, conn.SetReadDeadline(start.Add(d)))
	_, err := io.Copy(io.Discard, r)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return false, time.Since(start)
	}
	return true, time.Since(start) // EOF (err nil) or a reset
}

// The relay's HTTP server closes a keep-alive connection left idle for its
// idle timeout. Before, it set only ReadHeaderTimeout, and an idle
// connection stayed open for ever.
func TestRelayHTTP_IdleConnectionIsClosed(t *testing.T) {
	t.Parallel()
	_, addr := startRelayHTTP(t, nil, shortHTTP, nil)
	conn, err := net.DialTimeout("tcp", addr, 10*time.Second)
	require.NoError(t, err)
	defer conn.Close()
	_, err = io.WriteString(conn, "GET "+health.PathLive+" HTTP/1.1\r\nHost: relay\r\n\r\n")
	require.NoError(t, err)
	br := bufio.NewReader(conn)
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
	resp, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.False(t, resp.Close, "a keep-alive connection")

	closed, after := closedWithin(t, conn, br, shortHTTP.idle+10*time.Second)
	require.True(t, closed, "the idle connection was still open %s after its request (idle timeout %s)", after.Round(time.Millisecond), shortHTTP.idle)
}

// A client that sends its request slowly (slow-loris) is cut: headers
// after the read-header timeout, a body after the read timeout. Before,
// only the headers were bounded (at 10s), and a body trickled a byte at a
// time held the connection as long as the client liked.
func TestRelayHTTP_SlowClientIsCut(t *testing.T) {
	t.Parallel()
	_, addr := startRelayHTTP(t, nil, shortHTTP, nil)
	for _, tc := range []struct {
		name, head string
		bound      time.Duration
	}{
		{"headers", "GET " + health.PathReady + " HTTP/1.1\r\nHost: relay\r\n", shortHTTP.readHeader},
		{"body", "POST " + health.PathReady + " HTTP/1.1\r\nHost: relay\r\nContent-Length: 100000\r\n\r\n", shortHTTP.read},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			conn, err := net.DialTimeout("tcp", addr, 10*time.Second)
			require.NoError(t, err)
			defer conn.Close()
			_, err = io.WriteString(conn, tc.head)
			require.NoError(t, err)
			stop := make(chan struct{})
			var sent atomic.Int64
			var wg sync.WaitGroup
			wg.Add(1)
			go func() { // a byte every 100ms: never done, never silent
				defer wg.Done()
				tick := time.NewTicker(100 * time.Millisecond)
				defer tick.Stop()
				for {
					select {
					case <-stop:
						return
					case <-tick.C:
						b := "x"
						if tc.name == "headers" {
							b = "X-Slow: 1\r\n"[sent.Load()%11 : sent.Load()%11+1]
						}
						if _, err := io.WriteString(conn, b); err != nil {
							return
						}
						sent.Add(1)
					}
				}
			}()
			closed, after := closedWithin(t, conn, conn, tc.bound+5*time.Second)
			close(stop)
			wg.Wait()
			require.Positive(t, sent.Load(), "the client trickled its request")
			require.True(t, closed, "the slow %s still held the connection after %s (%d bytes trickled; bound %s)", tc.name, after.Round(time.Millisecond), sent.Load(), tc.bound)
		})
	}
}

// A flood of /readyz requests, with the relays' pool at its smallest,
// neither stops the relay publishing (the consumer keeps receiving events)
// nor takes more than one database connection for readiness (counted in
// pg_stat_activity by the readiness connection's application_name).
// Before, every request pinged through the relays' own pool.
func TestRelayHTTP_ReadinessFloodDoesNotStarveTheRelay(t *testing.T) {
	t.Parallel()
	var b [4]byte
	_, _ = rand.Read(b[:])
	app := "relayflood_" + hex.EncodeToString(b[:])
	var received atomic.Int64
	const topic = "flood_topic"
	s, addr := startRelayHTTP(t, map[string]string{
		relayenv.DatabaseURL: "$URL&application_name=" + app,
		relayenv.MaxConns:    "2",
	}, defaultHTTPTimeouts, func(sub message.Subscriber) error {
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		ch, err := sub.Subscribe(ctx, topic)
		if err != nil {
			return err
		}
		go func() {
			for m := range ch {
				received.Add(1)
				m.Ack()
			}
		}()
		return nil
	})
	u, err := url.Parse(s.URL)
	require.NoError(t, err)
	require.Equal(t, "", u.Query().Get("application_name"), "the schema's own URL has no application_name")

	stop := make(chan struct{})
	var requests, ok atomic.Int64
	var lastFailure atomic.Value
	var wg sync.WaitGroup
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := client.Get("http://" + addr + health.PathReady)
				requests.Add(1)
				if err == nil {
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						ok.Add(1)
					} else {
						lastFailure.Store(string(body))
					}
				}
			}
		}()
	}
	t.Cleanup(func() { close(stop); wg.Wait() })

	readyConns := func() int {
		var n int
		require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app+"/readyz").Scan(&n))
		return n
	}
	most, seen := 0, 0
	const events = 200
	written := 0
	deadline := time.Now().Add(60 * time.Second)
	// Until every event came and readiness answered 200 at least once: the
	// first answers may all be a cached "not started yet" (the flood can
	// start before the relays run).
	for received.Load() < events || ok.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("during the flood (%d /readyz requests, %d answered 200) the consumer received %d of %d events in 60s", requests.Load(), ok.Load(), received.Load(), events)
		}
		if written < events {
			writeEvents(t, s.DB, topic, 10)
			written += 10
		}
		n := readyConns()
		most = max(most, n)
		if n > 0 {
			seen++
		}
		time.Sleep(20 * time.Millisecond) // sampling pg_stat_activity, bounded by the deadline
	}
	require.Greater(t, requests.Load(), int64(200), "the flood happened")
	require.Positive(t, ok.Load(), "readiness answered 200 during the flood")
	require.Positive(t, seen, "readiness pinged through its own connection (application_name %s/readyz)", app)
	require.LessOrEqual(t, most, 1, "readiness connections at once during the flood")
	t.Logf("%d /readyz requests (%d answered 200), %d events received, readiness connections: at most %d; last 503: %v", requests.Load(), ok.Load(), received.Load(), most, lastFailure.Load())
}

// --addr takes the place of MILLWRIGHT_RELAY_ADDR, validated the same way
// and named in its error; without either the relay listens on :9090.
func TestRelayAddrFlag(t *testing.T) {
	t.Parallel()
	env := func(vars map[string]string) func(string) (string, bool) {
		return func(k string) (string, bool) { v, ok := vars[k]; return v, ok }
	}
	base := map[string]string{relayenv.DatabaseURL: "postgres://x/y"}
	withAddr := map[string]string{relayenv.DatabaseURL: "postgres://x/y", relayenv.Addr: "127.0.0.1:9191"}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want string
		err  string
	}{
		{"default", nil, base, relayenv.DefaultAddr, ""},
		{"env", nil, withAddr, "127.0.0.1:9191", ""},
		{"flag over env", []string{"--addr", "127.0.0.1:9292"}, withAddr, "127.0.0.1:9292", ""},
		{"bad flag", []string{"--addr", "9090"}, withAddr, "", `--addr="9090": want host:port or :port`},
		{"bad env", nil, map[string]string{relayenv.DatabaseURL: "postgres://x/y", relayenv.Addr: "localhost"}, "", relayenv.Addr + `="localhost": want host:port`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cmd := relayCmd()
			require.NoError(t, cmd.ParseFlags(tc.args))
			cfg, err := relayConfig(cmd, env(tc.env))
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, cfg.Addr)
		})
	}
	require.Contains(t, relayCmd().Flags().Lookup("addr").Usage, relayenv.Addr)
	require.Equal(t, ":9090", relayenv.DefaultAddr, "changing the default is a compatibility decision: see docs/operations.md")
}

// The relay takes --schema and $MILLWRIGHT_SCHEMA like every command: they
// set the search_path of MILLWRIGHT_DATABASE_URL (before, the relay
// listed --schema in its help and ignored it).
func TestRelaySchemaFlag(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"none", nil, nil, ""},
		{"env", nil, map[string]string{envSchema: "Orders_Env"}, "orders_env"},
		{"flag over env", []string{"--schema", "orders_flag"}, map[string]string{envSchema: "orders_env"}, "orders_flag"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			root := &cobra.Command{Use: "millwright"}
			addSchemaFlag(root)
			cmd := relayCmd()
			root.AddCommand(cmd)
			require.NoError(t, cmd.ParseFlags(tc.args))
			vars := map[string]string{relayenv.DatabaseURL: "postgres://h/db?sslmode=disable"}
			for k, v := range tc.env {
				vars[k] = v
			}
			cfg, err := relayConfig(cmd, func(k string) (string, bool) { v, ok := vars[k]; return v, ok })
			require.NoError(t, err)
			u, err := url.Parse(cfg.DatabaseURL)
			require.NoError(t, err)
			require.Equal(t, tc.want, u.Query().Get("search_path"))
		})
	}
}
