// Package embedded starts brokers inside the current process for
// development, examples and tests, and returns the transport.Config that
// reaches them.
//
// THESE ARE IN-PROCESS FAKES, NOT FOR PRODUCTION. Kafka is franz-go's kfake,
// a Kafka wire-protocol cluster kept in memory; Pub/Sub is the Google Cloud
// client's pstest. Both lose everything when the process exits, neither
// authenticates, and their timing differs from the real services (pstest,
// for one, caps delivery at about 800 msg/s and delivers one message per
// ordering key at a time). Use them to try millwright without a broker and
// to run tests; point the same code at a real cluster through configuration.
//
// Importing this package also links the fakes that configuration
// selects: MILLWRIGHT_TRANSPORT=kfake or pstest makes transport.Open start
// one and Close stop it. Nothing else links them (transport/all does not,
// nor does the millwright operator command), so a production program
// links neither fake unless it imports this package.
package embedded
