// Package outboxtest helps test code that writes to the millwright outbox.
//
// WaitDrained blocks until a running relay has published every committed
// event, so a test can write through its service, wait, and then assert on
// what its consumers received:
//
//	require.NoError(t, orders.Create(ctx, order))       // writes an outbox event
//	require.NoError(t, outboxtest.WaitDrained(ctx, db)) // relay published it
//	// ... assert on the consumer's side
package outboxtest
