//go:build linux

package faultproxy

import (
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// dropAll is a classic BPF socket filter that accepts nothing: the kernel
// discards every segment for the socket before TCP sees it (tcp_filter),
// so it neither acknowledges nor answers (no ACK, no RST).
var dropAll = []unix.SockFilter{{Code: unix.BPF_RET | unix.BPF_K, K: 0}}

// Blackhole makes every connection the proxy carries vanish for both
// peers without a word, as a host does when it freezes, loses power or
// its network path (a dropped NAT or conntrack entry, a partition): the
// proxy's sockets stop taking anything from either side (data, ACKs,
// keepalive probes, FIN, RST are all discarded by the kernel, unanswered),
// so no byte moves either way and neither peer is told. Each peer learns
// it only from its own TCP timers: retransmissions of what it sends,
// keepalive probes, TCP_USER_TIMEOUT. Connections opened after Blackhole
// are carried as usual. It returns how many sockets (two per connection)
// it silenced, or an error where the kernel refuses socket filters.
func (p *Proxy) Blackhole() (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for c := range p.conns {
		if err := attachDropAll(c); err != nil {
			return n, fmt.Errorf("faultproxy: blackholing %s: %w", c.LocalAddr(), err)
		}
		n++
	}
	return n, nil
}

func attachDropAll(c net.Conn) error {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return fmt.Errorf("not a TCP connection (%T)", c)
	}
	raw, err := tc.SyscallConn()
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
