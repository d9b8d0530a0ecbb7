package transport

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"strings"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/failure"
)

// Topic and consumer-group names reach SQL (watermill-sql makes tables of
// them) and broker administration (exchanges, queues, subscriptions), so
// they are checked against an allow-list before any of that happens: a
// name shaped like SQL or a path is refused with an error, never quoted
// and passed on.
var nameRe = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]*$`)

// maxNameLen is the longest topic or group name each kind accepts. Postgres
// truncates identifiers at 63 bytes, and watermill-sql prefixes topics with
// "watermill_offsets_" (18 bytes); Pub/Sub caps names at 255 and AMQP
// at 255 bytes including the "_<group>" suffix. NATS JetStream keeps a
// stream (named after its topic, with a 9-byte suffix when the topic has a
// dot) and its consumers in directories of the server's store, whose
// names a file system caps at 255 bytes.
var maxNameLen = map[Kind]int{
	Kafka:       249,
	AMQP:        120,
	GoogleCloud: 120,
	SQL:         45,
	GoChannel:   255,
	NATS:        200,
	anyKind:     255,
}

// anyKind stands for "some kind": Limits with no Kind refuse only the
// names that no kind takes.
const anyKind Kind = "(any kind)"

// ErrInvalidName is wrapped by the errors of Publish, Subscribe and
// Subscriber for a topic or group name outside the allow-list, and of
// Limits.Check (outbox.Add) for such a topic. Those errors are also marked
// failure.Permanent: the name does not become valid by retrying.
var ErrInvalidName = fmt.Errorf("invalid name")

// ValidateName reports whether name may be used as a topic or consumer
// group on kind: 1 to the kind's maximum length of letters, digits, '.',
// '_' and '-', starting with a letter or digit (Pub/Sub: at least 3,
// starting with a letter; NATS: no empty token between dots, nor a
// trailing dot).
func ValidateName(kind Kind, what, name string) error {
	return failure.Permanent(validateName(kind, what, name))
}

func validateName(kind Kind, what, name string) error {
	max := maxNameLen[kind]
	if max == 0 {
		max = 45
	}
	switch {
	case name == "":
		return fmt.Errorf("transport: %w: %s is empty", ErrInvalidName, what)
	case len(name) > max:
		return fmt.Errorf("transport: %w: %s %.40q... is %d bytes, %s allows %d", ErrInvalidName, what, name, len(name), kind, max)
	case !nameRe.MatchString(name):
		return fmt.Errorf("transport: %w: %s %q: use letters, digits, '.', '_' and '-', starting with a letter or digit", ErrInvalidName, what, name)
	case kind == NATS && (strings.Contains(name, "..") || strings.HasSuffix(name, ".")):
		return fmt.Errorf("transport: %w: %s %q: a NATS subject's tokens (between dots) may not be empty", ErrInvalidName, what, name)
	case kind == GoogleCloud && (len(name) < 3 || !(name[0] >= 'A' && name[0] <= 'Z' || name[0] >= 'a' && name[0] <= 'z')):
		return fmt.Errorf("transport: %w: %s %q: Pub/Sub names have at least 3 characters and start with a letter", ErrInvalidName, what, name)
	}
	return nil
}

// nameCache remembers names already validated, so the check costs one map
// read per publish.
// A map under a read lock, not a sync.Map: boxing the string key for
// sync.Map costs an allocation per publish.
type nameCache struct {
	kind Kind
	mu   sync.RWMutex
	ok   map[string]struct{}
}

func (c *nameCache) check(what, name string) error {
	c.mu.RLock()
	_, ok := c.ok[name]
	c.mu.RUnlock()
	if ok {
		return nil
	}
	if err := ValidateName(c.kind, what, name); err != nil {
		return err
	}
	c.mu.Lock()
	if c.ok == nil {
		c.ok = map[string]struct{}{}
	}
	if len(c.ok) < 10000 { // bounded: topics are few; a flood of names is not cached
		c.ok[name] = struct{}{}
	}
	c.mu.Unlock()
	return nil
}

// checkedPublisher refuses topics outside the allow-list.
type checkedPublisher struct {
	message.Publisher
	names *nameCache
}

func (p *checkedPublisher) Publish(topic string, msgs ...*message.Message) error {
	if err := p.names.check("topic", topic); err != nil {
		return err
	}
	return p.Publisher.Publish(topic, msgs...)
}

// checkedBatchPublisher is checkedPublisher for a BatchPublisher.
type checkedBatchPublisher struct {
	checkedPublisher
	batch BatchPublisher
}

func (p *checkedBatchPublisher) PublishBatch(topic string, msgs ...*message.Message) error {
	if err := p.names.check("topic", topic); err != nil {
		return err
	}
	return p.batch.PublishBatch(topic, msgs...)
}

// checkedInDatabasePublisher is checkedBatchPublisher for a publisher that
// is also an InDatabasePublisher (kind sql).
type checkedInDatabasePublisher struct {
	checkedBatchPublisher
	inDB InDatabasePublisher
}

func (p *checkedInDatabasePublisher) DB() *sql.DB { return p.inDB.DB() }

func (p *checkedInDatabasePublisher) PrepareTopic(ctx context.Context, topic string) error {
	if err := p.names.check("topic", topic); err != nil {
		return err
	}
	return p.inDB.PrepareTopic(ctx, topic)
}

func (p *checkedInDatabasePublisher) Table(topic string) (string, error) {
	return p.inDB.Table(topic)
}

var (
	_ BatchPublisher      = (*checkedBatchPublisher)(nil)
	_ InDatabasePublisher = (*checkedInDatabasePublisher)(nil)
)

func wrapPublisher(pub message.Publisher, names *nameCache) message.Publisher {
	cp := checkedPublisher{Publisher: pub, names: names}
	bp, ok := pub.(BatchPublisher)
	if !ok {
		return &cp
	}
	cb := checkedBatchPublisher{checkedPublisher: cp, batch: bp}
	if ip, ok := pub.(InDatabasePublisher); ok {
		return &checkedInDatabasePublisher{checkedBatchPublisher: cb, inDB: ip}
	}
	return &cb
}
