// Package keyed runs one ordered stream (a Kafka partition, a queue) with
// its keys in parallel and its position acknowledged in order: the broker
// independent core of the key-parallel consumers in transport/kafka.
//
// A Partition takes messages in stream order (Submit), each with a key and
// an offset, and hands them to a handler:
//
//   - messages of one key run strictly in order, one at a time: a key's
//     next message starts only after its previous one finished;
//   - messages of different keys run concurrently, at most
//     Config.Concurrency at once;
//   - at most Config.MaxInFlight messages are submitted and not finished:
//     Submit blocks beyond that, which is the backpressure on the fetch, so
//     memory stays bounded whatever the handler's speed;
//   - the watermark is the lowest offset not finished (or the offset after
//     the highest one submitted, when all are finished): everything below
//     it is done. Commit is called each time it advances, so a broker
//     position committed from it never passes an unfinished message, and a
//     crash redelivers only unfinished work (plus finished work above the
//     oldest unfinished message: at least once, deduplicate with package
//     idempotency).
//
// A handler that returns an error (a Watermill nack) has its message run
// again after Config.RetryDelay, in its key's place: the key's later
// messages wait, other keys go on, and the watermark stays at the failing
// message until it succeeds. A key that never succeeds thus holds its
// key and the watermark; the rest of the partition runs until
// MaxInFlight messages are waiting, then the fetch stops. Parking the key
// (issue 33, item 2) is a handler middleware's job, not this package's.
//
// A handler that panics is treated as one that returned an error: the
// partition recovers the panic (a *PanicError, counted by Panics and
// passed to the OnPanic function, which logs it with the message), and
// runs the message again after RetryDelay in its key's place; the worker,
// the other keys and the process go on.
//
// Discard drops waiting messages that became void (an AMQP channel that
// closed: the broker has them again), giving their slots back at once.
//
// Messages with the empty key have no order among themselves (a producer
// without a key spreads them over partitions anyway): each runs as its own
// key.
//
// Drain stops a partition (revoked by a rebalance, or the consumer
// closing): nothing new starts, a failed message is not run again, the
// running handlers get until the
// context's end to finish, then their contexts are cancelled; the returned
// watermark is final. Unstarted messages are simply not finished: the next
// owner of the partition gets them from the committed watermark.
package keyed
