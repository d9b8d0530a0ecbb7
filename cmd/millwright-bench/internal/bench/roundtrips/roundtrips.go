// Package roundtrips counts the round trips a Postgres client makes, for
// the benchmarks' "round trips per write" figures, whatever the driver:
// a loopback proxy between the client and the server counts, per
// connection, each time the client starts sending after the server has
// answered. A pipeline (pgx's batches, a multi-statement simple query) is
// one round trip; lib/pq's parse-then-execute of a statement with
// arguments is two.
package roundtrips

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
)

// Counter is a running proxy.
type Counter struct {
	ln     net.Listener
	target string
	count  atomic.Int64
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

// Start proxies to the host:port of rawURL (a postgres:// URL) and returns
// the counter and the URL through it.
func Start(rawURL string) (*Counter, string, error) {
	u, err := url.Parse(rawURL)
	if err != nil || !strings.HasPrefix(u.Scheme, "postgres") {
		return nil, "", fmt.Errorf("roundtrips: want a postgres:// URL")
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "5432")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	c := &Counter{ln: ln, target: host, conns: map[net.Conn]struct{}{}}
	c.wg.Add(1)
	go c.accept()
	u.Host = ln.Addr().String()
	return c, u.String(), nil
}

// Count returns the round trips so far, over every connection.
func (c *Counter) Count() int64 { return c.count.Load() }

// Close stops the proxy and its connections.
func (c *Counter) Close() error {
	c.mu.Lock()
	c.closed = true
	for cn := range c.conns {
		cn.Close()
	}
	c.mu.Unlock()
	err := c.ln.Close()
	c.wg.Wait()
	return err
}

func (c *Counter) track(cn net.Conn) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		cn.Close()
		return false
	}
	c.conns[cn] = struct{}{}
	return true
}

func (c *Counter) accept() {
	defer c.wg.Done()
	for {
		client, err := c.ln.Accept()
		if err != nil {
			return
		}
		if !c.track(client) {
			return
		}
		c.wg.Add(1)
		go func() {
			defer c.wg.Done()
			c.serve(client)
		}()
	}
}

// serve copies both ways; turn is 1 while the client speaks, 2 while the
// server does: a client write that follows a server write (or the first
// write) is a new round trip.
func (c *Counter) serve(client net.Conn) {
	defer client.Close()
	var d net.Dialer
	server, err := d.DialContext(context.Background(), "tcp", c.target)
	if err != nil {
		return
	}
	if !c.track(server) {
		return
	}
	defer server.Close()
	var turn atomic.Int32
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn, mine int32, count bool) {
		defer func() { done <- struct{}{} }()
		buf := make([]byte, 64<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 {
				if turn.Swap(mine) != mine && count {
					c.count.Add(1)
				}
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				if !errors.Is(err, io.EOF) {
					return
				}
				return
			}
		}
	}
	go pipe(server, client, 1, true)
	go pipe(client, server, 2, false)
	<-done
	client.Close()
	server.Close()
	<-done
	c.mu.Lock()
	delete(c.conns, client)
	delete(c.conns, server)
	c.mu.Unlock()
}
