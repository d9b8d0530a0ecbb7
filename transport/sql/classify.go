package sql

import (
	"fmt"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/transport"
)

// Publish inserts msgs into the topic's table with one statement (all or
// none), as watermill-sql does, after checking each message against the
// kind's limits (transport.DefaultLimits(transport.SQL): a UUID longer than
// the uuid column's 36 characters, a payload over 1 GiB). A message that
// fails them is not sent, and neither is the rest of the call: the error
// is a *batch.Error (transport.BatchError) whose refused messages' errors
// are permanent (transport.ErrMessageTooLarge, failure.Permanent) and whose
// others' are not, so the outbox relay fails only the refused rows and
// sends the others again. A database error of a one-message call that no
// retry can fix (a value too long for its column, a program limit) is
// permanent too; with several messages it cannot be told which one caused
// it, and it is returned as it is.
func (p *publisher) Publish(topic string, msgs ...*message.Message) error {
	if err := precheck(topic, msgs); err != nil {
		return err
	}
	err := p.Publisher.Publish(topic, msgs...)
	if len(msgs) == 1 {
		return classify(err)
	}
	return err
}

func precheck(topic string, msgs []*message.Message) error {
	limits := transport.DefaultLimits(transport.SQL)
	var failed map[int]error
	for i, m := range msgs {
		if err := limits.Check(topic, m.UUID, m.Payload, m.Metadata); err != nil {
			if failed == nil {
				failed = make(map[int]error, len(msgs))
			}
			failed[i] = fmt.Errorf("sql: message %d of %d refused: %w", i+1, len(msgs), err)
		}
	}
	if failed == nil {
		return nil
	}
	for i, m := range msgs {
		if failed[i] == nil {
			failed[i] = fmt.Errorf("sql: message %s not sent: another message of the same call was refused (send it again)", m.UUID)
		}
	}
	return &batch.Error{Failed: failed}
}

// classify marks a Postgres error that the same statement would get again
// as failure.Permanent: class 54 (program limit exceeded) and 22001 (a value
// too long for its column) wrap transport.ErrMessageTooLarge; other data
// exceptions (class 22, e.g. a character the encoding cannot hold) are
// permanent. Connection errors and the like are returned unchanged.
func classify(err error) error {
	code := storage.Code(err) // lib/pq's or pgx's
	if code == "" {
		return err
	}
	switch {
	case strings.HasPrefix(code, "54") || code == "22001":
		return failure.Permanent(fmt.Errorf("sql: %w: %w", transport.ErrMessageTooLarge, err))
	case strings.HasPrefix(code, "22"):
		return failure.Permanent(err)
	}
	return err
}
