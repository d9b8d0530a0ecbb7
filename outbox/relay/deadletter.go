package relay

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
)

// DeadLetterHandler is the handler name (metadata.DeadLetterHandler) of
// the dead letters the relay sends: the dlq tools show it as the party that
// gave up.
const DeadLetterHandler = "outbox.Relay"

// maxDeadLetterError bounds the error text in a dead letter's metadata (a
// broker limits header sizes; package dlq cuts at the same length).
const maxDeadLetterError = 4096

// deadLetterMessage is the copy of a failed event the relay publishes to
// dlTopic: the event (same UUID, payload and metadata) with the envelope
// package dlq writes for a consumer's poison message (metadata.DeadLetter*),
// so that dlq.Store records it like any other dead letter and `millwright
// dlq replay` sends it back to its original topic without --target. The
// relay has no consumer group; the handler is DeadLetterHandler. Attempts
// counts the publish attempts; first is the row's first failure
// (first_failed_at), last the failure that made it failed. The relay sends
// it once per failure (after recording it), and a copy sent again (a
// redelivery) has the same UUID and last failure, which dlq.Store records
// once.
func deadLetterMessage(rw row, dlTopic string, cause error, attempts int, first, last time.Time) *message.Message {
	m := message.NewMessage(rw.msg.UUID, rw.msg.Payload)
	for k, v := range rw.msg.Metadata {
		if !strings.HasPrefix(k, metadata.DeadLetterPrefix) {
			m.Metadata[k] = v
		}
	}
	reason := "exhausted" // dlq.ReasonExhausted
	if failure.IsPermanent(cause) {
		reason = "permanent" // dlq.ReasonPermanent
	}
	text := cause.Error()
	if len(text) > maxDeadLetterError {
		text = text[:maxDeadLetterError]
	}
	inner := cause
	for {
		u := errors.Unwrap(inner)
		if u == nil {
			break
		}
		inner = u
	}
	md := m.Metadata
	md.Set(metadata.DeadLetterOriginalTopic, rw.topic)
	md.Set(metadata.DeadLetterTopic, dlTopic)
	md.Set(metadata.DeadLetterHandler, DeadLetterHandler)
	md.Set(metadata.DeadLetterReason, reason)
	md.Set(metadata.DeadLetterError, text)
	md.Set(metadata.DeadLetterErrorType, fmt.Sprintf("%T", inner))
	md.Set(metadata.DeadLetterAttempts, strconv.Itoa(attempts))
	if first.IsZero() || first.After(last) {
		first = last
	}
	md.Set(metadata.DeadLetterFirstFailure, first.UTC().Format(time.RFC3339Nano))
	md.Set(metadata.DeadLetterLastFailure, last.UTC().Format(time.RFC3339Nano))
	md.Set(metadata.DeadLetterOriginalMessageID, rw.msg.UUID)
	m.SetContext(rw.msg.Context())
	return m
}
