package poll

import (
	"testing"
	"time"
)

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	n := 0
	Until(t, time.Second, func() bool { n++; return n == 3 }, "three calls")
	if n != 3 {
		t.Fatalf("cond called %d times, want 3", n)
	}
}

// fatalRecorder records Fatalf instead of stopping the goroutine.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (r *fatalRecorder) Helper() {}
func (r *fatalRecorder) Fatalf(format string, args ...any) {
	r.msg = format
	panic(r)
}

func TestUntilFailsAfterTheDeadline(t *testing.T) {
	r := &fatalRecorder{TB: t}
	func() {
		defer func() {
			if p := recover(); p != r {
				t.Fatalf("Until returned without failing (recovered %v)", p)
			}
		}()
		Until(r, 20*time.Millisecond, func() bool { return false }, "never")
	}()
	if r.msg == "" {
		t.Fatal("no failure message")
	}
}
