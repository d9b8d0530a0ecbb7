package app_test

import (
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// faultProxy is a TCP proxy in front of a broker (RabbitMQ, Postgres) that
// can simulate an outage: it closes every open connection and refuses new
// ones for a while. Only the transport under test goes through it, so the
// shared server stays up for everyone else.
type faultProxy struct {
	ln      net.Listener
	target  string
	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	until   time.Time
	refused atomic.Int64
}

func newFaultProxy(t *testing.T, target string) *faultProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &faultProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	go p.serve()
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		defer p.mu.Unlock()
		for c := range p.conns {
			_ = c.Close()
		}
	})
	return p
}

// Addr is the proxy's host:port.
func (p *faultProxy) Addr() string { return p.ln.Addr().String() }

// proxiedURL returns raw with its host replaced by the proxy's.
func (p *faultProxy) proxiedURL(t *testing.T, raw string) string {
	u, err := url.Parse(raw)
	require.NoError(t, err)
	u.Host = p.Addr()
	return u.String()
}

// outage closes every connection and refuses connections for d.
func (p *faultProxy) outage(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.until = time.Now().Add(d)
	for c := range p.conns {
		_ = c.Close()
		p.refused.Add(1)
	}
}

func (p *faultProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		down := time.Now().Before(p.until)
		p.mu.Unlock()
		if down {
			p.refused.Add(1)
			_ = c.Close()
			continue
		}
		go p.pipe(c)
	}
}

func (p *faultProxy) pipe(c net.Conn) {
	up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		_ = c.Close()
		return
	}
	p.mu.Lock()
	p.conns[c], p.conns[up] = struct{}{}, struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		done <- struct{}{}
	}
	go cp(up, c)
	go cp(c, up)
	<-done
	_ = c.Close()
	_ = up.Close()
	<-done
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, up)
	p.mu.Unlock()
}

// unavailablePublish is a pstest reactor that answers Publish with
// UNAVAILABLE while it is down.
type unavailablePublish struct {
	until   atomic.Int64
	refused atomic.Int64
}

func (r *unavailablePublish) outage(d time.Duration) { r.until.Store(time.Now().Add(d).UnixNano()) }

func (r *unavailablePublish) React(any) (bool, any, error) {
	if time.Now().UnixNano() < r.until.Load() {
		r.refused.Add(1)
		return true, nil, status.Error(codes.Unavailable, "pstest unavailable (injected by the test)")
	}
	return false, nil, nil
}
