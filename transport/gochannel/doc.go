// Package gochannel is millwright's in-process transport, built on
// Watermill's GoChannel: for unit tests and single-process development.
//
// Every subscriber receives every message: there are no consumer groups,
// and a group name is accepted and ignored. Nothing survives the process.
// With Persistent (the default) messages published before a subscriber
// started are replayed to it, which keeps them all in memory for the life
// of the transport.
//
// CloudEvents: messages are passed in memory; the metadata.Event* keys are
// kept as they are.
package gochannel
