// Package runner is the one lifecycle of millwright's long-running
// components (outbox.Relay, outbox.Cleaner, idempotency.Cleaner,
// saga.Orchestrator, the retention cleaners): Run blocks until the loop
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
package runner
