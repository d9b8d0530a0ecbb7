package main

import (
	"bytes"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/faultproxy"
	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport/transporttest"
)

// syncBuffer is an io.Writer safe to read while a process writes it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// A service started while its broker is down waits for it instead of
// exiting: `orders serve relay` on RabbitMQ behind a proxy that refuses
// every connection logs each failed attempt, and its /readyz answers 503
// "waiting for the broker" meanwhile; once the test has seen two logged
// failures it ends the outage, and the same process becomes ready,
// without a restart.
func TestServeWaitsForItsBroker(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	schema := pgtest.New(t) // the service migrates it itself
	u, err := url.Parse(transporttest.AMQPURL())
	require.NoError(t, err)
	proxy, err := faultproxy.New(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = proxy.Close() })
	proxy.Outage(time.Hour)
	u.Host = proxy.Addr()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	httpAddr := ln.Addr().String()
	require.NoError(t, ln.Close())

	out := &syncBuffer{}
	cmd := exec.Command(bin, "serve", "relay", "-database-url", pgtest.BaseURL(), "-schema", schema.Name,
		"-transport", u.String(), "-http", httpAddr, "-log", "error")
	cmd.Env = os.Environ()
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	var exitErr error
	go func() { exitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Kill()
			<-exited
		}
	})

	readyz := func() (int, string) {
		resp, err := http.Get("http://" + httpAddr + "/readyz")
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	// poll calls cond every 100ms until it holds, failing after limit or
	// if the process exits.
	poll := func(what string, limit time.Duration, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(limit)
		for !cond() {
			select {
			case <-exited:
				t.Fatalf("the service exited (%v) while %s:\n%s", exitErr, what, out.String())
			case <-time.After(100 * time.Millisecond):
			}
			if time.Now().After(deadline) {
				t.Fatalf("not %s within %s:\n%s", what, limit, out.String())
			}
		}
	}
	const failure = "Broker unreachable; waiting for it"
	var code int
	var body string
	poll("logging two failed attempts with /readyz saying it waits for the broker", 30*time.Second, func() bool {
		code, body = readyz()
		return strings.Count(out.String(), failure) >= 2 && code == http.StatusServiceUnavailable && strings.Contains(body, "waiting for the broker")
	})
	t.Logf("while the broker is down: /readyz %d:\n%s", code, body)
	require.Contains(t, out.String(), "waiting_for=\"the amqp broker\"")
	require.GreaterOrEqual(t, proxy.Refused(), int64(2), "the proxy refused fewer connections than failures were logged")

	proxy.Outage(0) // the broker is back
	poll("ready once the broker is back", 30*time.Second, func() bool {
		code, body = readyz()
		return code == http.StatusOK
	})
	require.Contains(t, body, "[+]broker ok")
	require.Contains(t, body, "[+]services ok")

	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-exited:
	case <-time.After(15 * time.Second):
		t.Fatalf("the service did not stop within 15s of SIGTERM:\n%s", out.String())
	}
}
