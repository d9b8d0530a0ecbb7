// Package runner is the one lifecycle of millwright's long-running
// components (outbox.Relay, outbox.Cleaner, idempotency.Cleaner,
// saga.Orchestrator, park.Parker's retrier, the retention cleaners): Run blocks until the loop
// returns; Close asks the loop to drain (finish its current round and
// return), cancels the loop's context if it has not returned within the
// close timeout, and waits for it; Running is closed once the loop runs.
//
// The rules every component then shares:
//
//   - Run may be called once. A second call before Close returns an error
//     wrapping ErrRunTwice at once.
//   - Close is idempotent and safe before, during and after Run, and from
//     several goroutines; every call returns once Run has returned.
//   - Run after Close returns nil at once without calling the loop (and
//     closes Running, so that nobody waits for it forever), whether or not
//     Run ran before.
//   - Cancelling Run's ctx cancels the loop's ctx at once (no drain).
//   - A close timeout of 0 cancels at once: Close then only waits for the
//     loop to notice its cancelled context.
//
// Guard is the loops' shared protection against a panic: a loop runs each
// round (and each record's work, in its own goroutine where it has one)
// under Guard.Do, which recovers a panic, logs it with the record's fields
// and the stack, counts it in MetricPanics (millwright_loop_panics_total,
// by component) and returns it as a *PanicError. The loop then sets the
// record aside (the relay fails the row, the saga orchestrator makes the
// instance stuck) or, with no record of its own (a cleaner), retries the
// round at its next interval: no loop ends because of one record.
package runner
