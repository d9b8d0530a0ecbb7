// Package metadata holds the Watermill message metadata keys that millwright
// components write and read. They are documented once, here.
//
// Event identity and context follow CloudEvents 1.0 attribute names with the
// "ce_" prefix (the Kafka binary-mode header names); the transports map them
// to each broker's own header convention.
package metadata
