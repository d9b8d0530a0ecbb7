// Package all registers every transport kind with package transport:
// Kafka, RabbitMQ, Google Cloud Pub/Sub, Postgres and the in-process
// gochannel, and links the development fakes (kfake and pstest, package
// transport/embedded). One import lets configuration alone choose among
// all five and the fakes:
//
//	import (
//		"github.com/millwright/millwright/transport"
//		_ "github.com/millwright/millwright/transport/all"
//	)
//
// It links every broker client and both fakes. A program that uses one
// kind imports only that kind's package instead (transport/kafka,
// transport/amqp, transport/googlecloud, transport/sql,
// transport/gochannel), as with database/sql drivers, and links no fake.
package all

import (
	_ "github.com/millwright/millwright/transport/amqp"        // registers amqp
	_ "github.com/millwright/millwright/transport/embedded"    // links the kfake and pstest development fakes
	_ "github.com/millwright/millwright/transport/gochannel"   // registers gochannel
	_ "github.com/millwright/millwright/transport/googlecloud" // registers googlecloud
	_ "github.com/millwright/millwright/transport/kafka"       // registers kafka
	_ "github.com/millwright/millwright/transport/sql"         // registers sql
)
