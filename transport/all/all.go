// Package all registers every real transport kind with package transport:
// Kafka, RabbitMQ, Google Cloud Pub/Sub, NATS JetStream, Postgres and the
// in-process gochannel. One import lets configuration alone choose among
// all six:
//
//	import (
//		"github.com/millwright/millwright/transport"
//		_ "github.com/millwright/millwright/transport/all"
//	)
//
// It links every broker client. A program that uses one kind imports only
// that kind's package instead (transport/kafka, transport/amqp,
// transport/googlecloud, transport/nats, transport/sql, transport/gochannel), as with
// database/sql drivers.
//
// It does not link the development fakes (kfake and pstest): a program
// that offers MILLWRIGHT_TRANSPORT=kfake or pstest imports
// transport/embedded as well, so that no production binary carries them.
package all

import (
	_ "github.com/millwright/millwright/transport/amqp"        // registers amqp
	_ "github.com/millwright/millwright/transport/gochannel"   // registers gochannel
	_ "github.com/millwright/millwright/transport/googlecloud" // registers googlecloud
	_ "github.com/millwright/millwright/transport/kafka"       // registers kafka
	_ "github.com/millwright/millwright/transport/nats"        // registers nats
	_ "github.com/millwright/millwright/transport/sql"         // registers sql
)
