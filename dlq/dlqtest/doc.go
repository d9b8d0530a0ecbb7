// Package dlqtest holds reusable tests of the dead-letter middleware that
// take a transport as arguments, so every transport (and every user's own
// publisher/subscriber setup) can be checked the same way:
//
//	func TestPoisonOnMyBroker(t *testing.T) {
//		pub, sub := openMyBroker(t)
//		dlqtest.TestPoisonDoesNotBlock(t, pub, sub, "orders-"+watermill.NewShortUUID())
//	}
//
// Guarantee checked: a message that always fails reaches "<topic>.dlq"
// after exactly PoisonAttempts attempts, with its metadata, and the ten
// messages published after it (same ordering key) are all processed.
package dlqtest
