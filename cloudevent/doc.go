// Package cloudevent holds millwright's CloudEvents 1.0 support: the
// attributes an event carries in Watermill metadata (the metadata.Event*
// keys), their validation, the protocol bindings that name them on each
// broker's wire, and versioned event types with a router that sends each
// version to its own handler.
//
//	msg := message.NewMessage(watermill.NewUUID(), payload)
//	cloudevent.Attributes{
//		ID: eventID, Source: "/orders-service", Type: cloudevent.Type("order.created", 1),
//		Time: now, Subject: orderID, DataContentType: "application/json",
//	}.Apply(msg)
//	if err := cloudevent.Validate(msg); err != nil { ... }
//
//	r := cloudevent.NewVersionRouter().
//		Handle("order.created.v1", handleV1).
//		Handle("order.created.v2", handleV2)
//	router.AddNoPublisherHandler("orders", "orders", sub, r.Handler())
//
// Binary content mode on every transport (package transport's sub-packages
// use the Kafka, AMQP and PubSub bindings in their marshalers):
//
//	attribute        metadata            Kafka header    AMQP                       Pub/Sub attribute
//	id               ce_id               ce_id           cloudEvents:id             ce-id
//	source           ce_source           ce_source       cloudEvents:source         ce-source
//	type             ce_type             ce_type         cloudEvents:type           ce-type
//	specversion      ce_specversion      ce_specversion  cloudEvents:specversion    ce-specversion
//	time             ce_time             ce_time         cloudEvents:time           ce-time
//	subject          ce_subject          ce_subject      cloudEvents:subject        ce-subject
//	datacontenttype  ce_datacontenttype  content-type    content-type property      Content-Type
//
// SQL and gochannel keep the metadata keys as they are. Consumers on every
// kind get the metadata keys back, whatever the wire names were.
//
// Guarantees: mapping is by name only; keys that are not CloudEvents
// attributes (traceparent, ordering_key, your own) pass through untouched.
// Validate checks what the CloudEvents spec requires and names each
// offending key; the transports do not validate, so non-CloudEvents
// messages still flow. A VersionRouter never drops a message: an event type
// with no handler and no fallback fails with failure.Permanent(ErrUnknownType)
// so the dead-letter queue keeps it until a consumer for it is deployed.
//
// Why not github.com/cloudevents/sdk-go: its validation is the same checks
// written here with the standard library, and its protocol packages bind to
// its own clients (AMQP 1.0 via go-amqp, not RabbitMQ's 0-9-1 client that
// Watermill uses), so it would add a dependency tree without replacing the
// marshalers.
package cloudevent
