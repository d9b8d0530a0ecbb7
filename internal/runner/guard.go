package runner

import (
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/internal/promreg"
)

// MetricPanics is the counter of panics a long-running loop recovered,
// with a "component" label (outbox.Relay, saga.Orchestrator,
// outbox.Cleaner, ...). The public packages export it as
// outbox.MetricLoopPanics and saga.MetricLoopPanics.
const MetricPanics = "millwright_loop_panics_total"

// PanicError is the error a Guard returns for a panic it recovered.
type PanicError struct {
	// Component is the loop's component ("outbox.Relay").
	Component string
	// Value is what was passed to panic.
	Value any
	// Stack is the goroutine's stack at the panic.
	Stack []byte
}

func (e *PanicError) Error() string {
	return fmt.Sprintf("%s: recovered from a panic: %v", e.Component, e.Value)
}

// Unwrap returns the panic's value when it is an error.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return err
}

// IsPanic reports whether err is (or wraps) a recovered panic.
func IsPanic(err error) bool {
	var pe *PanicError
	return errors.As(err, &pe)
}

// Guard keeps one panic from ending a long-running loop: Do runs a round
// (or the work of one record) and turns a panic into a *PanicError,
// logged at error level with the fields that name the record and the
// stack, and counted in MetricPanics. What to do with the record (set it
// aside for an operator) is the caller's: a loop with no per-record
// handling (a cleaner) just goes on with its next round. A nil *Guard
// recovers nothing. It is safe for concurrent use.
type Guard struct {
	component string
	logger    watermill.LoggerAdapter
	panics    prometheus.Counter
}

// NewGuard returns the guard of component, logging to logger (nil: none)
// and counting in MetricPanics registered on reg (nil: counted, not
// registered).
func NewGuard(component string, reg prometheus.Registerer, logger watermill.LoggerAdapter) (*Guard, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	vec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: MetricPanics,
		Help: "Panics a long-running millwright loop recovered from; the record it was working on is set aside (see the log line)."},
		[]string{"component"})
	if reg != nil {
		var err error
		if vec, err = promreg.Register(reg, vec); err != nil {
			return nil, fmt.Errorf("%s: registering %s: %w", component, MetricPanics, err)
		}
	}
	return &Guard{component: component, logger: logger, panics: vec.WithLabelValues(component)}, nil
}

// Panics returns the counter of g's component (tests read it).
func (g *Guard) Panics() prometheus.Counter { return g.panics }

// Do runs fn. A panic in fn is recovered, logged with fields and what,
// counted, and returned as a *PanicError; otherwise Do returns fn's error.
// Only panics of fn's own goroutine are recovered: a goroutine fn starts
// must use Do itself.
func (g *Guard) Do(what string, fields watermill.LogFields, fn func() error) (err error) {
	if g == nil {
		return fn()
	}
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		pe := &PanicError{Component: g.component, Value: v, Stack: debug.Stack()}
		g.panics.Inc()
		f := watermill.LogFields{"component": g.component, "stack": string(pe.Stack)}
		for k, val := range fields {
			f[k] = val
		}
		g.logger.Error(g.component+": recovered from a panic "+what, pe, f)
		err = pe
	}()
	return fn()
}
