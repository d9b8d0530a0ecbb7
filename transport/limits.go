package transport

import (
	"errors"
	"fmt"
	"iter"
	"maps"
	"unicode/utf8"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
)

// ErrMessageTooLarge is wrapped, together with failure.Permanent, by the
// publish errors of kinds whose broker (or client library) refused a
// message for its size, and by Limits.Check for a message over the kind's
// limit. Publishing it again cannot succeed: the outbox relay fails such a
// row at once instead of retrying it (see IsPermanent).
var ErrMessageTooLarge = errors.New("message too large")

// IsPermanent reports whether a publish error says the message can never be
// published as it is (ErrMessageTooLarge, ErrInvalidName, or any error
// marked failure.Permanent), so that retrying it only wastes the retry budget.
// The errors of this package and of the kind sub-packages are already
// marked failure.Permanent, so failure.IsPermanent gives the same answer for
// them.
func IsPermanent(err error) bool {
	return failure.IsPermanent(err) || errors.Is(err, ErrMessageTooLarge) || errors.Is(err, ErrInvalidName)
}

// Each kind's largest message by default, as Limits.Size counts it.
const (
	// KafkaMaxMessageBytes is Sarama's Producer.MaxMessageBytes default
	// (1 MiB), which it compares with ProducerMessage.ByteSize: payload,
	// key and headers plus record overhead. The broker's message.max.bytes
	// default (1 MiB + 12) then accepts the record batch.
	KafkaMaxMessageBytes = 1 << 20
	// AMQPMaxMessageBytes is RabbitMQ 4's max_message_size default
	// (16 MiB; RabbitMQ 3.8 to 3.13 took 128 MiB), compared with the body.
	AMQPMaxMessageBytes = 16 << 20
	// GoogleCloudMaxMessageBytes is Pub/Sub's limit of one publish request
	// (10 MB), which the Go client checks for each message (its encoded
	// size plus the topic's full name).
	GoogleCloudMaxMessageBytes = 10_000_000
	// SQLMaxMessageBytes is the largest Postgres field value (1 GiB - 1),
	// the bound of the BYTEA payload column of the sql transport's tables.
	SQLMaxMessageBytes = 1<<30 - 1
	// NATSMaxMessageBytes is nats-server's max_payload default (1 MiB),
	// which the client and the server compare with a message's headers
	// and payload together.
	NATSMaxMessageBytes = 1 << 20
)

// Pub/Sub's limits on attributes (https://cloud.google.com/pubsub/quotas).
const (
	pubSubMaxAttributes     = 100
	pubSubMaxAttributeKey   = 256
	pubSubMaxAttributeValue = 1024
	// pubSubMaxProjectID is the longest Google Cloud project id, assumed
	// when the project is not known.
	pubSubMaxProjectID = 30
)

// sqlMaxUUID is the length of watermill-sql's uuid column, VARCHAR(36).
const sqlMaxUUID = 36

// Limits are what a kind's brokers take: the topic names (ValidateName)
// and the largest message, counted as the kind counts a message on the
// wire. The outbox checks every event against them when it is written
// (outbox.WriterConfig.Limits), so that no event is stored that the relay
// could never publish.
type Limits struct {
	// Kind whose rules apply. "" applies the rules every kind shares:
	// names as ValidateName allows them on some kind, the size counted as
	// Kafka counts it (the smallest limit).
	Kind Kind
	// MaxBytes is the largest message, as Size counts it. 0 or less: no
	// size limit.
	MaxBytes int
	// Setting names what MaxBytes comes from, for errors (e.g. "Sarama's
	// Producer.MaxMessageBytes").
	Setting string
	// Project is the Pub/Sub project (kind googlecloud), whose name is part
	// of the publish request's size. Default: the longest project id.
	Project string
}

// DefaultLimits returns the limits of kind with its brokers' default
// settings ("" and unknown kinds: the rules every kind shares, Kafka's
// size limit).
func DefaultLimits(kind Kind) Limits {
	switch kind {
	case Kafka, "":
		return Limits{Kind: kind, MaxBytes: KafkaMaxMessageBytes, Setting: "Kafka's default: Sarama's Producer.MaxMessageBytes and the topic's max.message.bytes"}
	case AMQP:
		return Limits{Kind: kind, MaxBytes: AMQPMaxMessageBytes, Setting: "RabbitMQ's max_message_size (16 MiB by default since RabbitMQ 4)"}
	case GoogleCloud:
		return Limits{Kind: kind, MaxBytes: GoogleCloudMaxMessageBytes, Setting: "Pub/Sub's publish request limit of 10 MB"}
	case SQL:
		return Limits{Kind: kind, MaxBytes: SQLMaxMessageBytes, Setting: "Postgres's largest field value"}
	case NATS:
		return Limits{Kind: kind, MaxBytes: NATSMaxMessageBytes, Setting: "nats-server's max_payload (1 MiB by default)"}
	}
	return Limits{Kind: kind}
}

// LimitsFor returns the limits of the transport cfg configures: the kind's
// defaults, with what cfg changes (Kafka: the Tune function's
// Producer.MaxMessageBytes; Pub/Sub: the project). cfg need not be opened,
// so a service that only writes the outbox can take its relay's settings
// (FromEnv) without connecting.
func LimitsFor(cfg Config) Limits {
	l := DefaultLimits(cfg.Kind)
	if cfg.Kind == GoogleCloud && !cfg.GoogleCloud.Fake {
		l.Project = cfg.GoogleCloud.ProjectID
	}
	driversMu.RLock()
	d, ok := drivers[cfg.Kind]
	driversMu.RUnlock()
	if ok && d.Limits != nil {
		l = d.Limits(cfg, l)
	}
	return l
}

// Limits returns the limits of the open transport (LimitsFor its Config).
func (t *Transport) Limits() Limits { return t.limits }

// Size returns the size of the message the kind's publisher sends for a
// Watermill message with this topic, UUID, payload and metadata:
//
//   - kafka: Sarama's ProducerMessage.ByteSize for record batches (36
//     bytes of record overhead, the key (metadata.OrderingKey), the value,
//     and each header's name and value plus 10 bytes; the headers are the
//     metadata under their CloudEvents Kafka names and watermill's UUID
//     header);
//   - googlecloud: the publish request of this one message (its encoded
//     data, attributes and ordering key, and the topic's full name);
//   - amqp: the body (RabbitMQ's max_message_size counts nothing else);
//   - nats: the payload and the headers block as the client encodes it
//     (the metadata under their CloudEvents NATS names, the UUID header
//     and Nats-Msg-Id), which max_payload counts together;
//   - sql and others: the payload plus the metadata's names and values.
func (l Limits) Size(topic, uuid string, payload []byte, md map[string]string) int {
	return l.SizeSeq(topic, uuid, payload, maps.All(md))
}

// SizeSeq is Size with the metadata given as a sequence of its entries
// (each key once).
func (l Limits) SizeSeq(topic, uuid string, payload []byte, md iter.Seq2[string, string]) int {
	switch l.Kind {
	case Kafka, "":
		size := 36 + len(payload) + len(uuidHeader) + len(uuid) + 10
		for k, v := range md {
			if k == metadata.OrderingKey {
				size += len(v) // the record's key
			}
			size += len(cloudevent.Kafka.WireKey(k)) + len(v) + 10
		}
		return size
	case GoogleCloud:
		msg := protoBytesField(len(payload))
		msg += protoBytesField(protoBytesField(len(uuidHeader)) + protoBytesField(len(uuid)))
		for k, v := range md {
			if k == metadata.OrderingKey {
				msg += protoBytesField(len(v))
			}
			msg += protoBytesField(protoBytesField(len(cloudevent.PubSub.WireKey(k))) + protoBytesField(len(v)))
		}
		project := len(l.Project)
		if project == 0 {
			project = pubSubMaxProjectID
		}
		// The client refuses a message over 10 MB minus the topic field
		// and 5 bytes for the message's own field header.
		return msg + 5 + protoBytesField(len("projects//topics/")+project+len(topic))
	case AMQP:
		return len(payload)
	case NATS:
		// "NATS/1.0\r\n", "Name: value\r\n" per header, "\r\n".
		size := len(payload) + 10 + 2
		size += len(uuidHeader) + len(uuid) + 4
		size += len(natsMsgIDHeader) + len(uuid) + 4
		for k, v := range md {
			if k == metadata.DeadLetterReplayOf {
				size += len("-replay-") + len(v) // in Nats-Msg-Id (nats.MsgID)
			}
			size += len(cloudevent.NATS.WireKey(k)) + len(v) + 4
		}
		return size
	}
	size := len(payload)
	for k, v := range md {
		size += len(k) + len(v)
	}
	return size
}

// uuidHeader is the header or attribute in which watermill's Kafka and
// Pub/Sub marshalers carry the message UUID.
const uuidHeader = "_watermill_message_uuid"

// natsMsgIDHeader is JetStream's deduplication header, which the nats
// publisher sets to the message UUID (the outbox event id).
const natsMsgIDHeader = "Nats-Msg-Id"

// protoBytesField is the encoded size of a protobuf length-delimited field
// of n bytes with a one-byte tag.
func protoBytesField(n int) int {
	size := 2
	for v := n; v >= 0x80; v >>= 7 {
		size++
	}
	return size + n
}

// Check reports what in the message the kind's brokers would refuse: the
// topic name (ErrInvalidName) and what CheckMessage checks. Its errors are
// marked failure.Permanent.
func (l Limits) Check(topic, uuid string, payload []byte, md map[string]string) error {
	if err := l.ValidateTopic(topic); err != nil {
		return err
	}
	return l.CheckMessage(topic, uuid, payload, maps.All(md))
}

// CheckMessage reports what in the message, but its topic's name, the
// kind's brokers would refuse: the size (ErrMessageTooLarge, naming the
// limit and the setting), and the kind's other rules (Pub/Sub's attribute
// count and sizes, the sql transport's 36-character UUID). Its errors are
// marked failure.Permanent.
func (l Limits) CheckMessage(topic, uuid string, payload []byte, md iter.Seq2[string, string]) error {
	if l.MaxBytes > 0 {
		if size := l.SizeSeq(topic, uuid, payload, md); size > l.MaxBytes {
			kind := string(l.Kind)
			if kind == "" {
				kind = "any transport (counted as kafka)"
			}
			return failure.Permanent(fmt.Errorf("transport: %w: message %s for topic %s is %d bytes on the wire of %s (payload %d), over the limit of %d (%s)",
				ErrMessageTooLarge, uuid, topic, size, kind, len(payload), l.MaxBytes, l.Setting))
		}
	}
	switch l.Kind {
	case GoogleCloud:
		n := 1 // the UUID
		for k, v := range md {
			n++
			if w := cloudevent.PubSub.WireKey(k); len(w) > pubSubMaxAttributeKey {
				return failure.Permanent(fmt.Errorf("transport: %w: message %s for topic %s: metadata key %.40q... is %d bytes as a Pub/Sub attribute name, over Pub/Sub's limit of %d", ErrMessageTooLarge, uuid, topic, k, len(w), pubSubMaxAttributeKey))
			}
			if len(v) > pubSubMaxAttributeValue {
				return failure.Permanent(fmt.Errorf("transport: %w: message %s for topic %s: metadata %q is %d bytes, over Pub/Sub's limit of %d bytes per attribute value: carry it in the payload", ErrMessageTooLarge, uuid, topic, k, len(v), pubSubMaxAttributeValue))
			}
		}
		if n > pubSubMaxAttributes {
			return failure.Permanent(fmt.Errorf("transport: %w: message %s for topic %s has %d Pub/Sub attributes (its metadata and the UUID), over Pub/Sub's limit of %d", ErrMessageTooLarge, uuid, topic, n, pubSubMaxAttributes))
		}
	case SQL:
		if n := utf8.RuneCountInString(uuid); n > sqlMaxUUID {
			return failure.Permanent(fmt.Errorf("transport: %w: message UUID %.40q... for topic %s is too long: %d characters, over the %d of the sql transport's uuid column (watermill-sql's VARCHAR(36)): use a UUID", ErrMessageTooLarge, uuid, topic, n, sqlMaxUUID))
		}
	}
	return nil
}

// ValidateTopic reports a topic name the kind's brokers refuse
// (ValidateName; kind "": a name no kind takes).
func (l Limits) ValidateTopic(topic string) error {
	if l.Kind != "" {
		return ValidateName(l.Kind, "topic", topic)
	}
	return ValidateName(anyKind, "topic", topic)
}
