package shutdown

import (
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// The work in flight that a process made to exit names in its message.
var (
	flightMu sync.Mutex
	flightID uint64
	flights  = map[uint64]flight{}
)

type flight struct {
	what, id string
	since    time.Time
}

// Track records work in flight (what names it, e.g. "handler
// charge_payment"; id one item of it, e.g. a message UUID, or "") until
// done is called: a process made to exit after its grace names the work
// still in flight, grouped by what, with the oldest item and its age. It
// is safe for concurrent use; call done once.
func Track(what, id string) (done func()) {
	flightMu.Lock()
	flightID++
	k := flightID
	flights[k] = flight{what: what, id: id, since: time.Now()}
	flightMu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			flightMu.Lock()
			delete(flights, k)
			flightMu.Unlock()
		})
	}
}

// Middleware is a Watermill handler middleware that tracks each message
// in its handler (Track, named after the handler): add it to a service's
// router (router.AddMiddleware(shutdown.Middleware)), and a service
// still running past its grace names the handlers it waited for.
func Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		name := message.HandlerNameFromCtx(msg.Context())
		if name == "" {
			name = "a handler"
		} else {
			name = "handler " + name
		}
		defer Track(name, "message "+msg.UUID)()
		return h(msg)
	}
}

// inFlight describes the tracked work in flight, one entry per what,
// sorted: "handler charge_payment: 2 in flight, the oldest for 3.2s
// (message 6f1c...)".
func inFlight() []string {
	flightMu.Lock()
	type group struct {
		n      int
		oldest flight
	}
	groups := map[string]*group{}
	for _, f := range flights {
		g := groups[f.what]
		if g == nil {
			g = &group{oldest: f}
			groups[f.what] = g
		}
		g.n++
		if f.since.Before(g.oldest.since) {
			g.oldest = f
		}
	}
	flightMu.Unlock()
	out := make([]string, 0, len(groups))
	for what, g := range groups {
		s := fmt.Sprintf("%s: %d in flight, the oldest for %s", what, g.n, time.Since(g.oldest.since).Round(100*time.Millisecond))
		if g.oldest.id != "" {
			s += " (" + g.oldest.id + ")"
		}
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}
