// Package retry retries failing work with exponential backoff and jitter.
//
// Policy is the one backoff policy of millwright: the retry middleware, Do
// and the outbox relay use it alike. Errors decide whether to retry: wrap an
// error with failure.Permanent (package failure) to stop at once.
//
// # Middleware
//
// NewMiddleware returns a Watermill handler middleware:
//
//	rm, err := retry.NewMiddleware(retry.Config{
//		Policy: retry.Policy{InitialInterval: 200 * time.Millisecond, MaxAttempts: 5},
//		Logger: logger,
//	})
//	...
//	router.AddMiddleware(rm.Middleware)
//
// Most services should not use it alone but through dlq.NewMiddleware, which
// stacks panic recovery, this retry and the dead-letter queue in the right
// order.
//
// For code that does not handle messages, Do retries a function:
//
//	err := retry.Do(ctx, retry.Policy{}, func(ctx context.Context) error {
//		return callFlakyService(ctx)
//	})
//
// # Guarantees
//
//   - Jitter is on by default (JitterFull, see its doc for why): handlers that
//     fail together do not retry in lockstep.
//   - An error wrapped with failure.Permanent, anywhere in its chain, stops retrying
//     after the attempt that returned it.
//   - A panic in the handler is recovered into a *PanicError whose Stack
//     method returns the panicking goroutine's stack; it is retried like any
//     error (wrap with failure.Permanent and re-panic to change that).
//   - The wait between attempts ends as soon as the message's context (or
//     Do's ctx) ends: shutdown never waits out a backoff. The result is then
//     an *Error with Interrupted set, which the dlq package does not park:
//     the message is nacked and redelivered. A message whose context has
//     already ended is not handled at all.
//   - Every attempt starts with the message's original context, whatever the
//     previous attempt did to it (Watermill issue #467), and the middleware
//     restores it before returning. Attempt(msg.Context()) gives the attempt
//     number, 1-based.
//   - On giving up, the error returned is an *Error with the attempt count
//     and the first and last failure times, wrapping the handler's error.
//   - Produced messages are returned only from the successful attempt.
package retry
