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
