package app_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millwright/millwright/internal/testing/faultproxy"
)

// newFaultProxy starts a TCP proxy in front of a broker (RabbitMQ,
// Postgres) that can simulate an outage: it closes every open connection
// and refuses new ones for a while. Only the transport under test goes
// through it, so the shared server stays up for everyone else.
func newFaultProxy(t *testing.T, target string) *faultproxy.Proxy {
	t.Helper()
	p, err := faultproxy.New(target)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// proxiedURL returns raw with its host replaced by the proxy's.
func proxiedURL(t *testing.T, p *faultproxy.Proxy, raw string) string {
	u, err := p.URL(raw)
	require.NoError(t, err)
	return u
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
