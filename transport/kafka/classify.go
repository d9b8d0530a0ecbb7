package kafka

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/IBM/sarama"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/transport"
)

// classify marks the errors of one message that no retry can fix as
// failure.Permanent, so that the outbox relay fails its row at once, with
// the cause, instead of spending its retry budget on it:
//
//   - a message over Sarama's Producer.MaxMessageBytes (Sarama's own
//     check of that message alone, a ConfigurationError) wraps
//     transport.ErrMessageTooLarge;
//   - the broker's MESSAGE_TOO_LARGE refuses a whole record batch, which
//     Sarama fills with the messages of concurrent calls too: it wraps
//     transport.ErrMessageTooLarge, and is permanent, only when km alone,
//     in a batch of its own, exceeds the topic's max.message.bytes (read
//     from the broker); another message's refusal is returned as it is,
//     to be retried;
//   - a topic the broker calls invalid (INVALID_TOPIC_EXCEPTION) wraps
//     transport.ErrInvalidName.
//
// Other errors are returned unchanged (a leader change, a timeout: worth
// retrying).
func (p *Publisher) classify(km *sarama.ProducerMessage, err error) error {
	var ce sarama.ConfigurationError
	switch {
	case err == nil:
		return nil
	case errors.Is(err, sarama.ErrMessageSizeTooLarge):
		limit, lerr := p.topicMaxMessageBytes(km.Topic)
		if lerr != nil {
			return fmt.Errorf("%w (reading topic %s's max.message.bytes to tell whether this message alone is too large: %v)", err, km.Topic, lerr)
		}
		size := singleBatchSize(km)
		if size <= limit {
			return fmt.Errorf("%w (this message alone, %d bytes as a record batch, fits the topic's max.message.bytes of %d: another message of its batch was too large)", err, size, limit)
		}
		return failure.Permanent(fmt.Errorf("%w: %w: it is %d bytes as a record batch, over topic %s's max.message.bytes of %d (raise it, or store large data elsewhere and send a reference)", transport.ErrMessageTooLarge, err, size, km.Topic, limit))
	case errors.As(err, &ce) && strings.Contains(string(ce), "MaxMessageBytes"):
		return failure.Permanent(fmt.Errorf("%w: %w (raise Sarama's Producer.MaxMessageBytes with Config.Tune, and the topic's max.message.bytes, or store large data elsewhere and send a reference)", transport.ErrMessageTooLarge, err))
	case errors.Is(err, sarama.ErrInvalidTopic):
		return failure.Permanent(fmt.Errorf("%w: %w", transport.ErrInvalidName, err))
	}
	return err
}

// topicMaxMessageBytes reads the topic's effective max.message.bytes (its
// own setting or the broker's message.max.bytes).
func (p *Publisher) topicMaxMessageBytes(topic string) (int, error) {
	// Not closed: Close would close the publisher's client.
	admin, err := sarama.NewClusterAdminFromClient(p.client)
	if err != nil {
		return 0, err
	}
	entries, err := admin.DescribeConfig(sarama.ConfigResource{Type: sarama.TopicResource, Name: topic, ConfigNames: []string{"max.message.bytes"}})
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		if e.Name == "max.message.bytes" {
			return strconv.Atoi(e.Value)
		}
	}
	return 0, errors.New("the broker did not return it")
}

// recordBatchOverhead is the size of a record batch (v2) without its
// records: base offset, length, leader epoch, magic, CRC, attributes,
// last offset delta, timestamps, producer id and epoch, base sequence and
// record count. The broker compares max.message.bytes with the batch.
const recordBatchOverhead = 61

// singleBatchSize is the size of a record batch holding km alone,
// uncompressed, as the broker counts it.
func singleBatchSize(km *sarama.ProducerMessage) int {
	varint := func(n int) int { return len(binary.AppendVarint(nil, int64(n))) }
	bytesField := func(n int) int { return varint(n) + n }
	body := 1 + varint(0) + varint(0) // attributes, timestamp delta, offset delta
	if km.Key != nil {
		body += bytesField(km.Key.Length())
	} else {
		body += varint(-1)
	}
	if km.Value != nil {
		body += bytesField(km.Value.Length())
	} else {
		body += varint(-1)
	}
	body += varint(len(km.Headers))
	for _, h := range km.Headers {
		body += bytesField(len(h.Key)) + bytesField(len(h.Value))
	}
	return recordBatchOverhead + varint(body) + body
}
