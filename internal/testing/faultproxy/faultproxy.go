// Package faultproxy is a TCP proxy for tests that cuts a client off from a
// real server without touching the server: it closes every connection it
// carries (Cut), can refuse new ones for a while (Outage) and can hold
// back what the server sends (Hold) while the client's bytes still go
// through, so the server acts on requests whose replies the client does
// not get, or silence the connections it carries for good (Blackhole: a
// dropped NAT or conntrack entry, a dead middlebox; no RST, no FIN, every
// byte either way dropped) while new ones go through. HalfOpen makes the connections half-open, as a dropped NAT or
// conntrack entry does: the client's side is reset while the server's
// stays open, unanswered, until the server gives up on it. Only the
// client under test goes through it, so a shared server stays up for every
// other test. Its counters let a test prove the fault happened.
package faultproxy

import (
	"fmt"
	"io"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy forwards TCP connections from its own loopback address to a target.
type Proxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	pipes map[*pipe]struct{}
	// dead holds the connections (both ends) Blackhole silenced.
	dead map[net.Conn]struct{}
	// closed is closed by Close.
	closed    chan struct{}
	closeOnce sync.Once
	until     time.Time
	held      chan struct{} // non-nil while Hold is on; closed by Release

	cut       atomic.Int64
	refused   atomic.Int64
	heldReads atomic.Int64
	sent      atomic.Int64
	received  atomic.Int64
	holed     atomic.Int64
	dropped   atomic.Int64
	accepted  atomic.Int64
	halfOpen  atomic.Int64
	halfLive  atomic.Int64
}

// pipe is one proxied connection: the client's and the server's ends.
type pipe struct {
	client, server net.Conn
	// half is set by HalfOpen: the client's end is reset, the server's
	// stays open and what the server sends is read and dropped.
	half atomic.Bool
}

// New starts a proxy to target (host:port) on a free loopback port.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("faultproxy: listening for %s: %w", target, err)
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}, pipes: map[*pipe]struct{}{},
		dead: map[net.Conn]struct{}{}, closed: make(chan struct{})}
	go p.serve()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Through starts a proxy to the host of rawURL (defaultPort when the URL
// names none) and returns it with rawURL through it.
func Through(rawURL, defaultPort string) (*Proxy, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, "", fmt.Errorf("faultproxy: %w", err)
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), defaultPort)
	}
	p, err := New(host)
	if err != nil {
		return nil, "", err
	}
	through, err := p.URL(rawURL)
	if err != nil {
		_ = p.Close()
		return nil, "", err
	}
	return p, through, nil
}

// URL returns raw (a URL) with its host replaced by the proxy's.
func (p *Proxy) URL(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("faultproxy: %w", err)
	}
	u.Host = p.Addr()
	return u.String(), nil
}

// Cut closes every connection the proxy carries; clients may reconnect at
// once.
func (p *Proxy) Cut() { p.Outage(0) }

// Outage closes every connection the proxy carries and refuses new ones
// for d.
func (p *Proxy) Outage(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.until = time.Now().Add(d)
	for c := range p.conns {
		_ = c.Close()
		p.cut.Add(1)
	}
}

// Blackhole silences every connection the proxy carries now, for good:
// both ends stay open and the proxy keeps reading from them, but drops
// every byte in either direction (DroppedBytes counts them), as a dropped
// NAT entry or a dead middlebox does. No RST or FIN reaches either side,
// so each end learns of it only from a timeout of its own, and one end
// closing it leaves the other open (until Close). Connections accepted
// later go through.
func (p *Proxy) Blackhole() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		if _, ok := p.dead[c]; !ok {
			p.dead[c] = struct{}{}
			p.holed.Add(1)
		}
	}
}

// Blackholed counts the connections (both ends) Blackhole silenced.
func (p *Proxy) Blackholed() int64 { return p.holed.Load() }

// DroppedBytes counts the bytes of blackholed connections the proxy read
// and dropped (either direction): what a test asserts to prove that
// traffic was lost, not merely absent.
func (p *Proxy) DroppedBytes() int64 { return p.dropped.Load() }

// silenced reports whether c was blackholed.
func (p *Proxy) silenced(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.dead[c]
	return ok
}

// HalfOpen makes every connection the proxy carries half-open: the
// client's end is reset (a TCP RST, as a middlebox that lost the
// connection's state answers), while the server's end stays open, gets
// nothing more from the client and has what the server sends read and
// dropped, until the server closes it (its heartbeat or keepalive
// timeout). New connections are carried as usual. It returns how many
// connections it made half-open.
func (p *Proxy) HalfOpen() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for pp := range p.pipes {
		if pp.half.Swap(true) {
			continue
		}
		if tc, ok := pp.client.(*net.TCPConn); ok {
			_ = tc.SetLinger(0) // close sends RST
		}
		_ = pp.client.Close()
		p.halfOpen.Add(1)
		p.halfLive.Add(1)
		n++
	}
	return n
}

// HalfOpened counts the connections HalfOpen made half-open.
func (p *Proxy) HalfOpened() int64 { return p.halfOpen.Load() }

// HalfOpenLive counts the half-open connections whose server end the
// server has not closed yet: while it is positive, the server still
// holds a connection whose client is gone.
func (p *Proxy) HalfOpenLive() int64 { return p.halfLive.Load() }

// Accepted counts the connections the proxy accepted (refused ones
// included): a test reads it to see a client reconnect.
func (p *Proxy) Accepted() int64 { return p.accepted.Load() }

// Hold stops forwarding what servers send to clients (replies, confirms,
// heartbeats) until Release; the proxy keeps reading it only as far as
// its buffer, so TCP holds back the rest. Clients' bytes still go through.
func (p *Proxy) Hold() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.held == nil {
		p.held = make(chan struct{})
	}
}

// Release forwards what Hold held back, in order, and everything after.
func (p *Proxy) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.held != nil {
		close(p.held)
		p.held = nil
	}
}

// HeldReads counts the reads from servers that Hold kept from their
// clients: what a test asserts to prove replies were held.
func (p *Proxy) HeldReads() int64 { return p.heldReads.Load() }

// ClientBytes counts the bytes forwarded from clients to servers.
func (p *Proxy) ClientBytes() int64 { return p.sent.Load() }

// ServerBytes counts the bytes forwarded from servers to clients.
func (p *Proxy) ServerBytes() int64 { return p.received.Load() }

// CutConns counts the connections (both ends) closed by Cut and Outage.
func (p *Proxy) CutConns() int64 { return p.cut.Load() }

// Refused counts the connections closed or refused by the faults: what a
// test asserts to prove its fault reached the client.
func (p *Proxy) Refused() int64 { return p.cut.Load() + p.refused.Load() }

// Close stops accepting and closes every connection.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() { close(p.closed) })
	err := p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
	return err
}

func (p *Proxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.accepted.Add(1)
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

func (p *Proxy) pipe(c net.Conn) {
	up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		_ = c.Close()
		return
	}
	pp := &pipe{client: c, server: up}
	p.mu.Lock()
	p.conns[c], p.conns[up] = struct{}{}, struct{}{}
	p.pipes[pp] = struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	stop := make(chan struct{}) // closed once either direction ends
	go func() {
		_, _ = io.Copy(countingWriter{w: up, n: &p.sent, p: p, src: c}, c)
		done <- struct{}{}
	}()
	go func() {
		p.copyReplies(pp, stop)
		done <- struct{}{}
	}()
	<-done
	if p.silenced(c) {
		// One end closed a blackholed connection: its FIN, like its
		// bytes, never reaches the other end, which stays open until
		// the proxy closes (a server session on a dead path lives on).
		<-p.closed
	}
	if pp.half.Load() {
		// Half-open: the server's end stays until the server (or Close)
		// ends it; copyReplies drops what it sends meanwhile.
		<-done
		close(stop)
		_ = c.Close()
		_ = up.Close()
		p.halfLive.Add(-1)
	} else {
		close(stop)
		_ = c.Close()
		_ = up.Close()
		<-done
		if pp.half.Load() { // made half-open as the connection ended
			p.halfLive.Add(-1)
		}
	}
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, up)
	delete(p.pipes, pp)
	delete(p.dead, c)
	delete(p.dead, up)
	p.mu.Unlock()
}

// copyReplies copies from the server to the client, waiting while Hold is
// on; it gives up a held chunk once stop closes (the connection is gone).
// Once the pipe is half-open it reads and drops what the server sends.
func (p *Proxy) copyReplies(pp *pipe, stop <-chan struct{}) {
	buf := make([]byte, 32*1024)
	for {
		n, err := pp.server.Read(buf)
		if n > 0 && p.silenced(pp.server) {
			p.dropped.Add(int64(n))
			if err != nil {
				return
			}
			continue
		}
		if n > 0 && !pp.half.Load() {
			p.mu.Lock()
			held := p.held
			p.mu.Unlock()
			if held != nil {
				p.heldReads.Add(1)
				select {
				case <-held:
				case <-stop:
					return
				}
			}
			w, werr := pp.client.Write(buf[:n])
			p.received.Add(int64(w))
			if werr != nil && !pp.half.Load() {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// countingWriter forwards src's bytes to w, counting them in n, or drops
// them (counted in p.dropped) once src is blackholed.
type countingWriter struct {
	w   net.Conn
	n   *atomic.Int64
	p   *Proxy
	src net.Conn
}

func (cw countingWriter) Write(b []byte) (int, error) {
	if cw.p.silenced(cw.src) {
		cw.p.dropped.Add(int64(len(b)))
		return len(b), nil
	}
	n, err := cw.w.Write(b)
	cw.n.Add(int64(n))
	return n, err
}
