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
	require.NoError(t, syscall.Kill(syscall.Getpid(), syscall.SIGTERM))
	<-ctx.Done()
	signalled := time.Now()
	select {
	case code := <-exited:
		require.Equal(t, 1, code)
	case <-time.After(5 * time.Second):
		t.Fatal("no exit after Grace")
	}
	require.Less(t, time.Since(signalled), time.Second)
	require.GreaterOrEqual(t, time.Since(signalled), Grace-50*time.Millisecond)
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
