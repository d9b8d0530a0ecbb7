// Package shutdown gives a program that runs millwright components a
// context cancelled by SIGINT or SIGTERM, and a bound on how long the
// program may take to return after that: what millwright's own commands
// and examples use, for a service's main.
//
//	func main() {
//		ctx, stop := shutdown.Context(context.Background(), "orders")
//		defer stop()
//		if err := run(ctx); err != nil { // every wait takes ctx
//			log.Fatal(err)
//		}
//	}
//
// Guarantees. The context ends at the first SIGINT or SIGTERM, with
// context.Cause naming the signal ("terminated signal received"), so every
// call that takes it returns at once with an error saying what it was
// doing. Some waits cannot hear a context (a library's Close, reading a
// result a silent server never finishes): once Grace (plus ExtendGrace) has
// passed since the signal and stop has not been called, the process prints
// to stderr what it is still waiting for (the Postgres calls in flight on
// connections millwright opened, such as postgres.Open's) and exits with
// status 1. An outbox relay stopped that way leaves its batch leased;
// another relay republishes it after the lease, as after a crash. A
// parent context that ends is not a signal: nothing is forced then.
//
// DeadlinePassed tells a deadline that has passed by the clock from one
// whose timer has not fired yet, for messages that say which limit ended a
// wait.
package shutdown
