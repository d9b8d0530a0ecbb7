// Package googlecloud is millwright's Google Cloud Pub/Sub transport, built
// on watermill-googlecloud. Applications reach it through package transport.
//
// Each consumer group is a subscription named "<topic>_<group>" (created on
// first subscribe, as is the topic), so every group gets every message and
// the members of a group share the work. Message ordering is enabled on
// publisher and subscriptions: messages with the same metadata.OrderingKey
// are delivered in publish order; others are unordered. A nack makes
// Pub/Sub redeliver; an unacked message is redelivered after its deadline.
//
// A consumer that dies (SIGKILL, a lost machine) or closes holding messages
// leaves them leased until its last lease ends, at most Config.MaxExtension
// (default one minute) after its last renewal; then Pub/Sub redelivers them
// to the group's other members, for an ordering key its unacked message
// and every later one, in order. RedeliveryBound states that bound. A
// subscription that has messages outstanding in a process and moves no
// more (nothing delivered, acked or nacked) for longer than it is logged as
// an error naming the subscription and exported (MetricStalled, with
// MetricOutstanding and MetricLastDelivery; Config.Registerer).
//
// On Google's emulator (EmulatorHost or PUBSUB_EMULATOR_HOST) it differs:
// the emulator (0.8.20) does not notice that a streaming pull was cancelled
// or lost its connection (its bundled gRPC throws NoSuchMethodError, seen
// in its log), so the dead stream keeps its share of the ordering keys,
// which nobody else then receives, and keeps taking unkeyed messages. This
// transport therefore gives every streaming pull on the emulator a gRPC
// deadline (EmulatorStreamDeadline, 20s; the client reopens the stream),
// which the emulator enforces itself, and leases of EmulatorMaxExtension
// (10s), the lease it gives what it streams to a dead consumer; a dead
// consumer's messages come back within EmulatorStreamDeadline plus two
// leases (40s), in waves, with duplicates. When a stream ends, the
// emulator may give its ordering keys to another member of the group while
// the first still holds earlier messages of them, so on the emulator a key
// can be processed out of order across consumers around a stream's end. A
// program that uses Google's client on the emulator directly needs the
// same deadline.
//
// Where it falls short: a subscription only receives messages published
// after it was created, so create the groups' subscriptions before
// publishing (subscribe once at deployment, or list the groups in
// Config.DeclareGroups; a publish to a topic with no subscription at all
// fails with ErrNoSubscription unless Config.AllowUnreceived); messages
// are limited to 10 MB; an ordering key
// whose publish failed is paused until resumed (this transport resumes it
// automatically and returns the error).
//
// CloudEvents (Pub/Sub protocol binding, binary mode): the metadata.Event*
// attributes travel as attributes "ce-<attr>" and datacontenttype as the
// "Content-Type" attribute; consumers get the same metadata keys back.
package googlecloud
