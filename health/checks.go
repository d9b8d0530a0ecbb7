package health

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// LastSuccesser is what the Relay check needs: *relay.Relay has it
// (LastSuccess is the end of its last round that completed without error;
// zero before the first).
type LastSuccesser interface {
	Running() <-chan struct{}
	LastSuccess() time.Time
}

// Relay checks an outbox relay: ready once Run has started and its last
// successful round ended at most maxAge ago. A relay that cannot reach the
// database or the broker stops succeeding and turns not ready after
// maxAge; choose maxAge well above the relay's PollInterval (an idle
// relay completes a round at least every PollInterval) and above the
// slowest batch. maxAge <= 0 means one minute.
func Relay(r LastSuccesser, maxAge time.Duration) Checker {
	if maxAge <= 0 {
		maxAge = time.Minute
	}
	return CheckerFunc(func(context.Context) error {
		if r == nil {
			return errors.New("no relay: pass the *relay.Relay to health.Relay")
		}
		if !closed(r.Running()) {
			return errors.New("not running: Relay.Run has not started")
		}
		last := r.LastSuccess()
		if last.IsZero() {
			return errors.New("no successful round yet")
		}
		if age := time.Since(last); age > maxAge {
			return fmt.Errorf("last successful round %s ago (limit %s): the relay cannot reach the database or the broker, or a batch is stuck; see its log", age.Round(time.Millisecond), maxAge)
		}
		return nil
	})
}

// RouterState is what the Router check needs: *message.Router has it.
type RouterState interface {
	IsRunning() bool
	IsClosed() bool
}

// Router checks a Watermill router: ready while it runs (its handlers are
// subscribed) and is not closed.
func Router(r RouterState) Checker {
	return CheckerFunc(func(context.Context) error {
		switch {
		case r == nil:
			return errors.New("no router: pass the *message.Router to health.Router")
		case r.IsClosed():
			return errors.New("closed: the router has stopped")
		case !r.IsRunning():
			return errors.New("not running: Router.Run has not subscribed its handlers yet")
		}
		return nil
	})
}

// OrchestratorState is what the Orchestrator check needs:
// *saga.Orchestrator has it.
type OrchestratorState interface {
	Running() <-chan struct{}
	Stopped() bool
}

// Orchestrator checks a saga orchestrator: ready while its Run loop (which
// fires step timeouts and compensation retries) runs.
func Orchestrator(o OrchestratorState) Checker {
	return CheckerFunc(func(context.Context) error {
		switch {
		case o == nil:
			return errors.New("no orchestrator: pass the *saga.Orchestrator to health.Orchestrator")
		case o.Stopped():
			return errors.New("stopped: Orchestrator.Run returned or Close was called; step timeouts no longer fire")
		case !closed(o.Running()):
			return errors.New("not running: Orchestrator.Run has not started; step timeouts do not fire")
		}
		return nil
	})
}

// Pinger is what the Ping check needs: a postgres.DB has it, on either
// driver (and so does a *sql.DB).
type Pinger interface {
	PingContext(ctx context.Context) error
}

// Ping checks that p (a database pool) answers a ping within the check's
// timeout.
func Ping(p Pinger) Checker {
	return CheckerFunc(func(ctx context.Context) error {
		if p == nil {
			return errors.New("no database: pass the postgres.DB to health.Ping")
		}
		return p.PingContext(ctx)
	})
}

func closed(ch <-chan struct{}) bool {
	if ch == nil {
		return false
	}
	select {
	case <-ch:
		return true
	default:
		return false
	}
}
