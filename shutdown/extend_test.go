package shutdown

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// ExtendGrace lets a draining program (millwright relay) take longer than
// Grace before the backstop exits it.
func TestExtendGraceDelaysTheBackstop(t *testing.T) {
	out, exited := hookExit(t)
	const extra = 400 * time.Millisecond
	ExtendGrace(extra)
	t.Cleanup(func() { ExtendGrace(0) })

	ctx, stop := Context(context.Background(), "prog")
	defer stop()
	signalled := time.Now() // before the signal: no later than the backstop's start
	require.NoError(t, syscall.Kill(syscall.Getpid(), syscall.SIGTERM))
	<-ctx.Done()
	select {
	case code := <-exited:
		require.Equal(t, 1, code)
	case <-time.After(30 * time.Second):
		t.Fatal("no exit 30s after the signal (Grace + extra is " + (Grace + extra).String() + ")")
	}
	require.GreaterOrEqual(t, time.Since(signalled), Grace+extra)
	require.Contains(t, out.String(), "prog: terminated signal received; still waiting after ")
}
