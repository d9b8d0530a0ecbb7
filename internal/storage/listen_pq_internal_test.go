package storage

import (
	"errors"
	"testing"
)

// lib/pq's ListenerConn.Ping panics when the server answers its empty
// query with an error; the listener's ping goroutine turns that into a
// failed ping (the connection is replaced) instead of ending the process.
func TestRecoverPingTurnsAPanicIntoAFailedPing(t *testing.T) {
	t.Parallel()
	err := recoverPing(func() error { panic(errors.New("pq: the server said no")) })
	if !errors.Is(err, errPingPanicked) {
		t.Fatalf("got %v, want errPingPanicked", err)
	}
	want := errors.New("no connection")
	if err := recoverPing(func() error { return want }); err != want {
		t.Fatalf("got %v, want %v", err, want)
	}
}
