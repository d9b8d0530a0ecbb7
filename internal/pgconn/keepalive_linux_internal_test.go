//go:build linux

package pgconn

import (
	"context"
	"net"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// The sockets millwright dials probe an idle server after KeepaliveIdle,
// every KeepaliveInterval, KeepaliveCount times (Go's default: 15 s, then
// 9 probes 15 s apart), on both drivers' dialers.
func TestClientSocketKeepalives(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	cfg, err := PgxConfig("postgres://u@" + ln.Addr().String() + "/db?sslmode=disable")
	require.NoError(t, err)
	dials := map[string]func() (net.Conn, error){
		"pq": func() (net.Conn, error) {
			return (&dialer{}).DialContext(context.Background(), "tcp", ln.Addr().String())
		},
		"pgx": func() (net.Conn, error) {
			return cfg.ConnConfig.DialFunc(context.Background(), "tcp", ln.Addr().String())
		},
	}
	for name, dial := range dials {
		c, err := dial()
		require.NoError(t, err, name)
		got := map[int]int{}
		raw, err := c.(syscall.Conn).SyscallConn()
		require.NoError(t, err)
		require.NoError(t, raw.Control(func(fd uintptr) {
			for _, opt := range []struct{ level, name int }{
				{unix.SOL_SOCKET, unix.SO_KEEPALIVE},
				{unix.IPPROTO_TCP, unix.TCP_KEEPIDLE},
				{unix.IPPROTO_TCP, unix.TCP_KEEPINTVL},
				{unix.IPPROTO_TCP, unix.TCP_KEEPCNT},
			} {
				v, err := unix.GetsockoptInt(int(fd), opt.level, opt.name)
				require.NoError(t, err)
				got[opt.name] = v
			}
		}))
		_ = c.Close()
		require.Equal(t, map[int]int{
			unix.SO_KEEPALIVE:  1,
			unix.TCP_KEEPIDLE:  int(KeepaliveIdle.Seconds()),
			unix.TCP_KEEPINTVL: int(KeepaliveInterval.Seconds()),
			unix.TCP_KEEPCNT:   KeepaliveCount,
		}, got, name)
	}
}
