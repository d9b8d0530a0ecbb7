//go:build linux

package faultproxy

import (
	"fmt"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// dropAll is a classic BPF socket filter that accepts nothing: the kernel
// discards every segment for the socket before TCP sees it (tcp_filter),
// so it neither acknowledges nor answers (no ACK, no RST).
var dropAll = []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0}}

// Vanish makes the proxy's side vanish for both peers without a word,
// as a host does when it freezes, loses power or its network path (a
// dropped NAT or conntrack entry, a partition): the sockets of every
// connection it carries stop taking anything from either side (data,
// ACKs, keepalive probes, FIN, RST are all discarded by the kernel,
// unanswered) and stop sending their own keepalive probes, so no byte
// moves either way and neither peer is told. New connections are refused
// (counted by Refused). Each peer learns it only from its own TCP timers:
// retransmissions of what it sends, keepalive probes, TCP_USER_TIMEOUT.
// Close ends it. It returns how many sockets of connections (two per
// connection) it silenced, or an error where the kernel refuses socket
// filters.
func (p *Proxy) Vanish() (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	// New connections (a lib/pq cancel request, a reconnect) are
	// refused, as in an Outage that lasts until Close. (Linux takes no
	// socket filter on a listening socket, so they cannot go unanswered.)
	p.until = time.Now().Add(100 * 365 * 24 * time.Hour)
	n := 0
	for c := range p.conns {
		// The proxy's own keepalive probes would end the connection
		// for the peer when they go unanswered: a vanished host sends
		// none.
		if tc, ok := c.(*net.TCPConn); ok {
			if err := tc.SetKeepAlive(false); err != nil {
				return n, fmt.Errorf("faultproxy: blackholing %s: %w", c.LocalAddr(), err)
			}
		}
		if err := attachDropAll(c); err != nil {
			return n, fmt.Errorf("faultproxy: blackholing %s: %w", c.LocalAddr(), err)
		}
		n++
	}
	return n, nil
}

func attachDropAll(s any) error {
	sc, ok := s.(syscall.Conn)
	if !ok {
		return fmt.Errorf("not a socket (%T)", s)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return err
	}
	var serr error
	if err := raw.Control(func(fd uintptr) {
		prog := unix.SockFprog{Len: uint16(len(dropAll)), Filter: &dropAll[0]}
		serr = unix.SetsockoptSockFprog(int(fd), unix.SOL_SOCKET, unix.SO_ATTACH_FILTER, &prog)
	}); err != nil {
		return err
	}
	return serr
}
