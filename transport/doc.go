// Package transport opens a Watermill publisher and subscribers for one of
// five brokers, chosen by configuration alone, so the same application code
// runs on Kafka, RabbitMQ, Google Cloud Pub/Sub, Postgres or in process.
//
//	cfg, err := transport.FromEnv() // MILLWRIGHT_TRANSPORT=kafka://h1:9092,h2:9092
//	if err != nil { ... }
//	tr, err := transport.Open(ctx, cfg)
//	if err != nil { ... }
//	defer tr.Close()
//	pub := tr.Publisher()
//	sub, err := tr.Subscriber("billing") // consumer group
//
// Application code imports only this package; the broker packages are
// behind it (transport/kafka, transport/amqp, transport/googlecloud,
// transport/sql, transport/gochannel).
//
// Guarantees common to every kind: Publish returns nil only once the broker
// has accepted the message (Kafka acks=all, RabbitMQ publisher confirms,
// Pub/Sub server ack, a committed Postgres insert); delivery is at least
// once (a nacked or unacked message comes back); each consumer group gets
// every message and its members share them; messages carrying
// metadata.OrderingKey keep their order where the kind can (see the README
// table). Open fails with an error naming the field for bad configuration,
// and within ConnectTimeout (10s by default) for a broker that does not
// answer. Passwords never appear in errors or in String.
//
// For development and tests, package transport/embedded starts an
// in-process Kafka (kfake) or Pub/Sub (pstest) fake and returns the Config
// that reaches it.
package transport
