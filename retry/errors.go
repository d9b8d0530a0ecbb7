package retry

import (
	"errors"
	"fmt"
	"runtime/debug"
	"strings"
	"time"
)

// PanicError is a recovered panic, returned by the middleware and Do in
// place of the panic. It carries the panicking goroutine's stack.
type PanicError struct {
	// Value is what was passed to panic.
	Value any
	stack string
}

// newPanicError records the current stack; call it from the deferred
// function that recovered.
func newPanicError(v any) *PanicError {
	return &PanicError{Value: v, stack: trimStack(string(debug.Stack()))}
}

// trimStack drops the frames of the recovery machinery (debug.Stack, the
// deferred function, runtime's panic) so the stack starts at the function
// that panicked: dead letters truncate long values, and the top frames are
// the ones an operator needs.
func trimStack(s string) string {
	header, rest, ok := strings.Cut(s, "\n")
	if !ok {
		return s
	}
	i := strings.Index(rest, "\npanic(")
	if i < 0 {
		return s
	}
	after := rest[i+1:]
	// Skip the "panic(...)" line and its file:line line.
	for range 2 {
		_, after, ok = strings.Cut(after, "\n")
		if !ok {
			return s
		}
	}
	return header + "\n" + after
}

// Error describes the panic value; the stack is available from Stack so
// that error strings stay one line.
func (e *PanicError) Error() string { return fmt.Sprintf("panic: %v", e.Value) }

// Stack returns the stack trace of the goroutine that panicked, as printed
// by runtime/debug.Stack.
func (e *PanicError) Stack() string { return e.stack }

// Unwrap returns the panic value when it was an error (panic(err)), so
// errors.Is and errors.As see through the panic.
func (e *PanicError) Unwrap() error {
	if err, ok := e.Value.(error); ok {
		return err
	}
	return nil
}

// Error is returned by the middleware and Do when they give up: it wraps the
// last attempt's error with the attempt history. errors.Is and errors.As see
// through it to the handler's error.
type Error struct {
	// Err is the last attempt's error.
	Err error
	// Attempts is how many attempts ran, the first included.
	Attempts int
	// FirstFailure and LastFailure are when the first and the last failed
	// attempt returned.
	FirstFailure, LastFailure time.Time
	// Interrupted is true when the context ended during a backoff: the work
	// was neither exhausted nor permanently failed, and should be redelivered
	// rather than dead-lettered.
	Interrupted bool
}

// Error returns the last error with the attempt count.
func (e *Error) Error() string {
	if e.Interrupted {
		return fmt.Sprintf("%v (retry interrupted after %d attempts)", e.Err, e.Attempts)
	}
	return fmt.Sprintf("%v (after %d attempts)", e.Err, e.Attempts)
}

// Unwrap returns the last attempt's error.
func (e *Error) Unwrap() error { return e.Err }

// Final reports whether err is a final outcome of retried work: the retries
// are exhausted or the error is permanent. It is false for nil and for work
// interrupted by its context ending mid-backoff. An error that did not go
// through the middleware or Do counts as final (one attempt, nothing more to
// come from this process).
func Final(err error) bool {
	if err == nil {
		return false
	}
	var re *Error
	if errors.As(err, &re) {
		return !re.Interrupted
	}
	return true
}
