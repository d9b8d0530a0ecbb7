// Package transport opens a Watermill publisher and subscribers for one of
// six brokers, chosen by configuration alone, so the same application code
// runs on Kafka, RabbitMQ, Google Cloud Pub/Sub, NATS JetStream, Postgres
// or in process.
//
//	cfg, err := transport.FromEnv() // MILLWRIGHT_TRANSPORT=kafka://h1:9092,h2:9092
//	if err != nil { ... }
//	tr, err := transport.Open(ctx, cfg)
//	if err != nil { ... }
//	defer tr.Close()
//	pub := tr.Publisher()
//	sub, err := tr.Subscriber("billing") // consumer group
//
// Application code calls only this package. Each kind registers itself
// when its sub-package is imported, as database/sql drivers do, so a
// program links only the broker clients it uses:
//
//	import _ "github.com/millwright/millwright/transport/kafka" // Kafka only
//	import _ "github.com/millwright/millwright/transport/all"   // all six (no fake)
//
// A kind that is not linked is refused by Validate, Open, ParseURL and
// FromEnv with an error naming the import to add. A 24-line program that
// opens a transport from the environment builds to 9.7 MB with no kind,
// 9.7 MB with gochannel, 12.3 MB with sql or amqp, 16.3 MB with kafka,
// 26.9 MB with googlecloud and 39.2 MB with transport/all; before the
// split, importing transport linked everything: 33.5 MB (go1.26,
// linux/amd64). Each kind's settings are a type of this package
// (KafkaConfig, ...), which its sub-package names Config; how they are
// read (its URL form, its MILLWRIGHT_ variables, the sources
// Config.Setting names, its description) is the sub-package's own
// Settings (transport/<kind>/settings.go), registered with its Driver:
// ParseURL and FromEnv only dispatch to the linked kinds.
//
// Guarantees common to every kind: Publish returns nil only once the broker
// has accepted the message (Kafka acks=all, RabbitMQ publisher confirms,
// Pub/Sub server ack, a JetStream stream's acknowledgement, a committed
// Postgres insert); delivery is at least
// once (a nacked or unacked message comes back); each consumer group gets
// every message and its members share them; messages carrying
// metadata.OrderingKey keep their order where the kind can (see the README
// table). Open fails at once with an error naming the field for bad
// configuration, and for what the broker refuses for good (credentials, a
// listener that does not speak the configured TLS or SASL). A broker it
// cannot reach (refused, closed, no answer within the kind's
// ConnectTimeout, 10s by default) is waited for, attempt after attempt
// with backoff (0.5s doubling to 5s, jittered), each failure logged with what Open waits for
// and passed to Config.OnWait (health.Waiter makes readiness say "waiting
// for the broker"), until Open's ctx ends or Config.WaitForBroker passes
// (NoWait: the first failure is returned; env MILLWRIGHT_WAIT_FOR_BROKER):
// a service started while its broker restarts does not exit. Errors name
// the setting each value came from (Config.Setting): the environment
// variable, MILLWRIGHT_TRANSPORT's URL, or the Config field set in code.
// Passwords never appear in errors or in String.
//
// Limits (DefaultLimits, LimitsFor, Transport.Limits) are what a kind's
// brokers take: topic names (ValidateName) and the largest message,
// counted as the kind counts it on the wire (Kafka: Sarama's ByteSize,
// payload, key and headers; Pub/Sub: the publish request; RabbitMQ: the
// body; NATS: payload and headers, against max_payload; sql: payload and
// metadata). An outbox.Writer built with them
// (outbox.WriterConfig.Limits) refuses at write time what the relay could
// never publish. A
// message a broker or client refuses for its size or name fails with an
// error marked failure.Permanent and wrapping ErrMessageTooLarge or
// ErrInvalidName (IsPermanent), from the kafka, googlecloud and sql
// publishers and the name check of every kind.
//
// Development fakes, NOT FOR PRODUCTION, are selected by configuration
// alone, in programs that link them (import transport/embedded;
// transport/all does not, so a production build never does):
// MILLWRIGHT_TRANSPORT=kfake (or kfake://) makes Open start an
// in-process Kafka (franz-go's kfake), and MILLWRIGHT_TRANSPORT=pstest (or
// pstest://PROJECT) an in-process Pub/Sub (the Google client's pstest);
// Close stops them, and everything they held is lost. Config.String says
// "development fake" and Open logs it at info level. Tests that need the
// fakes' controls (kfake's ControlKey) use package transport/embedded.
//
// # Watermill's universal suite
//
// Every kind passes github.com/ThreeDotsLabs/watermill/pubsub/tests.TestPubSub
// in full mode (googlecloud's full run in a CI stage of its own,
// MILLWRIGHT_TEST_PUBSUB_FULL=1, short mode beside the others; its
// TestContinueAfterSubscribeClose runs in short mode only, and
// TestPubSubSubscriberClosedMidReadLosesNothing is that scenario in full
// with a wait bounded by the lease a closed subscriber's messages keep:
// see .ci/run), through Open, on real brokers (TestConformance:
// PostgreSQL 15, RabbitMQ 3.10, Apache Kafka 4.1.1 in KRaft mode, Google's
// Pub/Sub emulator, nats-server 2.15.3 with JetStream; scripts/services.sh
// starts them). Reconnecting is
// proven by TestReconnectUnderLoad, in a stage of its own
// (MILLWRIGHT_TEST_RECONNECT=1, .ci/run), because its cut reaches every
// client of the broker: RabbitMQ closes all connections (rabbitmqctl
// close_all_connections), the test's own Postgres sessions are
// terminated, the Kafka broker process is restarted on its log directory,
// the emulator's connections are cut through a TCP proxy (a restart
// would lose the emulator's in-memory topics, which is not a reconnect),
// and nats-server is restarted on its JetStream store (proven by its new
// server id).
// It is upstream's TestReconnect scenario with exact bookkeeping. Upstream's
// TestReconnect (the same environment variable enables it, by hand) records
// a message as published only after Publish returns, in a goroutine it
// does not synchronise with, and compares as soon as the last message
// arrives: it reports correct transports as losing or inventing messages
// (on amqp always, where RabbitMQ delivers a persistent message before it
// confirms it; on sql and kafka now and then), so CI does not gate on it.
// Each kind declares only the Features it has; the cases the suite skips, and why:
//
//   - TestPublishSubscribeInOrder and TestNoAck (both need GuaranteedOrder):
//     skipped on kafka, amqp, googlecloud and gochannel, and on nats with
//     KeyParallelism (messages without a key run concurrently); nats one
//     message at a time declares it, with one subscriber
//     (GuaranteedOrderWithSingleSubscriber: the members of a group share
//     its consumer). The suite
//     publishes without ordering keys, and those kinds order only per key
//     (Kafka partition, Pub/Sub ordering key) or not across redeliveries
//     (a requeued AMQP message falls behind with prefetch > 1). Per-key
//     order is this package's own test (TestPublishBatchKeepsEveryKeyInOrder)
//     and the outbox relay's (TestRelayOnEveryTransport).
//   - TestContinueAfterSubscribeClose and TestConcurrentClose: skipped on
//     sql and gochannel, the kinds with ExactlyOnceDelivery; upstream skips
//     them for that feature ("not supported yet").
//   - TestConsumerGroups: skipped on gochannel, which has no groups (every
//     subscriber gets every message).
//   - TestNewSubscriberReceivesOldMessages: skipped on every kind. A new
//     subscriber of an existing group continues from the group's position
//     (that is what the consumer groups promise); only a new group starts
//     at the oldest message, which TestConsumerGroups covers.
//   - TestReconnect: skipped unless MILLWRIGHT_TEST_RECONNECT=1 (above),
//     and on gochannel, which has no broker to cut.
package transport
