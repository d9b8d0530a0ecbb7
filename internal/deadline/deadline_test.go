package deadline

import (
	"context"
	"testing"
	"time"
)

func TestPassed(t *testing.T) {
	if Passed(context.Background()) {
		t.Error("a context without deadline has not passed it")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	if Passed(ctx) {
		t.Error("a deadline an hour away has not passed")
	}
	cancel()
	if !Passed(ctx) {
		t.Error("a cancelled context has ended")
	}
	// A deadline in the past whose timer has not ended ctx yet: a
	// context whose Deadline says so but whose Err is still nil.
	if !Passed(spent{context.Background()}) {
		t.Error("a deadline in the past has passed, whatever Err says")
	}
}

type spent struct{ context.Context }

func (spent) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }
