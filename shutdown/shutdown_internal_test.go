package shutdown

import (
	"bytes"
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// hookExit makes the backstop report its exit code on exited and write to
// out instead of exiting the test binary, until the test ends.
func hookExit(t *testing.T) (out *bytes.Buffer, exited <-chan int) {
	out = &bytes.Buffer{}
	codes := make(chan int, 1)
	exit, stderr = func(code int) { codes <- code }, out
	t.Cleanup(func() { exit, stderr = nil, nil })
	return out, codes
}

// A program that does not return after the signal is made to exit after
// Grace, saying what it was waiting for; one that returns is left alone.
func TestBackstopExitsAfterGrace(t *testing.T) {
	out, exited := hookExit(t)

	ctx, stop := Context(context.Background(), "prog")
	defer stop()
	// Taken before the signal is sent, so no later than the backstop's
	// start: the lower bound below holds however late this goroutine runs
	// (taken after <-ctx.Done(), a goroutine scheduled 50 ms late saw
	// the exit "early").
	signalled := time.Now()
	require.NoError(t, syscall.Kill(syscall.Getpid(), syscall.SIGTERM))
	<-ctx.Done()
	select {
	case code := <-exited:
		require.Equal(t, 1, code)
	case <-time.After(30 * time.Second):
		t.Fatal("no exit 30s after the signal (Grace is " + Grace.String() + ")")
	}
	// No upper bound but the one above: how soon after Grace the exit
	// comes is scheduling (it had 250 ms on a loaded machine).
	require.GreaterOrEqual(t, time.Since(signalled), Grace)
	require.Contains(t, out.String(), "prog: terminated signal received; still waiting after ")
	require.Contains(t, out.String(), "no Postgres call in flight")

	ctx2, stop2 := Context(context.Background(), "prog")
	require.NoError(t, syscall.Kill(syscall.Getpid(), syscall.SIGINT))
	<-ctx2.Done()
	stop2() // returned in time
	select {
	case <-exited:
		t.Fatal("exited although the program returned")
	case <-time.After(Grace + 200*time.Millisecond):
	}
}

func TestMessageNamesWhatItWaitsFor(t *testing.T) {
	t.Parallel()
	got := Message("millwright", errors.New("interrupt signal received"), 750*time.Millisecond,
		[]string{"postgres at 127.0.0.1:5432: connecting (1.2s)"})
	require.Equal(t, "millwright: interrupt signal received; still waiting after 750ms for postgres at 127.0.0.1:5432: connecting (1.2s); exiting", got)
}
