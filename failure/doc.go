// Package failure classifies errors for the code that decides what to do
// with them: a permanent error is one that retrying cannot fix (a
// malformed payload, a rejected business rule, a message too large for
// the broker, an invalid topic name).
//
// Mark one with Permanent where it arises; test for it with IsPermanent
// (or errors.As with *PermanentError) wherever it is decided:
//
//	if err := json.Unmarshal(msg.Payload, &order); err != nil {
//		return failure.Permanent(fmt.Errorf("order %s: %w", msg.UUID, err))
//	}
//
// The retry middleware and retry.Do stop at once on a permanent error,
// the dead-letter middleware records the message without spending more
// attempts, transport.Open does not wait for a broker whose answer is
// permanent, and the transports' publishers mark what no resend can fix.
//
// The package imports only the standard library, so that transports,
// cloudevent and application code can mark errors without linking the
// retry middleware.
package failure
