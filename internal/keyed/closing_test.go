package keyed

import (
	"context"
	"testing"
	"time"
)

func TestWithClosingCancelsOnClose(t *testing.T) {
	closing := make(chan struct{})
	ctx, cancel := WithClosing(context.Background(), closing)
	defer cancel()
	if ctx.Err() != nil {
		t.Fatal("cancelled before closing was closed")
	}
	close(closing)
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("not cancelled 10 s after closing was closed")
	}
}

func TestWithClosingFollowsParent(t *testing.T) {
	parent, stop := context.WithCancel(context.Background())
	ctx, cancel := WithClosing(parent, make(chan struct{}))
	defer cancel()
	stop()
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("not cancelled 10 s after its parent")
	}
}
