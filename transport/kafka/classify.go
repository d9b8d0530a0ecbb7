package kafka

import (
	"errors"
	"fmt"
	"strings"

	"github.com/IBM/sarama"

	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/transport"
)

// classify marks the errors of one message that no retry can fix as
// retry.Permanent, so that the outbox relay fails its row at once, with
// the cause, instead of spending its retry budget on it:
//
//   - a message over Sarama's Producer.MaxMessageBytes (Sarama's own
//     check, a ConfigurationError) or the topic's max.message.bytes (the
//     broker's MESSAGE_TOO_LARGE) wraps transport.ErrMessageTooLarge;
//   - a topic the broker calls invalid (INVALID_TOPIC_EXCEPTION) wraps
//     transport.ErrInvalidName;
//   - a record the broker refuses (INVALID_RECORD, e.g. no key on a
//     compacted topic) is permanent.
//
// Other errors are returned unchanged (a leader change, a timeout: worth
// retrying).
func classify(err error) error {
	var ce sarama.ConfigurationError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, sarama.ErrMessageSizeTooLarge):
		return retry.Permanent(fmt.Errorf("%w: %w (the broker's message.max.bytes, or the topic's max.message.bytes, is smaller than the message: raise it, or store large data elsewhere and send a reference)", transport.ErrMessageTooLarge, err))
	case errors.As(err, &ce) && strings.Contains(string(ce), "MaxMessageBytes"):
		return retry.Permanent(fmt.Errorf("%w: %w (raise Sarama's Producer.MaxMessageBytes with Config.Tune, and the broker's message.max.bytes, or store large data elsewhere and send a reference)", transport.ErrMessageTooLarge, err))
	case errors.Is(err, sarama.ErrInvalidTopic):
		return retry.Permanent(fmt.Errorf("%w: %w", transport.ErrInvalidName, err))
	case errors.Is(err, sarama.ErrInvalidRecord):
		return retry.Permanent(err)
	}
	return err
}
