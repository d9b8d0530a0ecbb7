package park

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// ErrNotParked is returned (wrapped) by Store.Release and Store.Retry when
// the key is not parked (or, for Release without force, not held).
var ErrNotParked = errors.New("key not parked")

// Key is a parked key as the operator sees it.
type Key struct {
	// Handler and Key name it. Key holds the key's bytes, whatever they
	// are (a binary Kafka key too). When Keyless is true the lane is the
	// one of a message without a key, parked alone, and Key is its UUID: no
	// real key shares it, whatever its text.
	Handler, Key string
	Keyless      bool
	// Messages counts its parked messages, the head included.
	Messages int64
	// DueAt is when the head is retried next (meaningless while Held).
	DueAt time.Time
	// Held is true when the head was dead-lettered under Hold.
	Held bool
	// Attempts are the head's attempts (in place included), Rounds the
	// retrier's.
	Attempts, Rounds int
	// FirstFailure and LastFailure of the head; zero when it has not run
	// since it became the head.
	FirstFailure, LastFailure time.Time
	// LastError is the head's last error.
	LastError string
	// DeadLetterID is the held head's row in millwright_dead_letters (0
	// when not held).
	DeadLetterID int64
	// ParkedSince is when the key was parked.
	ParkedSince time.Time
}

// Message is one parked message.
type Message struct {
	ID          int64
	UUID, Topic string
	Payload     []byte
	// Metadata is the message's metadata, byte for byte.
	Metadata map[string]string
	// DeadLetterID is its dead letter, when it was dead-lettered (it is a
	// held head, or was one); 0 when none.
	DeadLetterID int64
	ParkedAt     time.Time
}

// Store inspects and releases parked keys: what `millwright parked` runs.
// Safe for concurrent use.
type Store struct {
	pool storage.Pool
	err  error
}

// NewStore returns a Store on db. A nil db gives a Store whose every
// method fails saying so.
func NewStore(db postgres.DB) *Store {
	pool, err := storage.PoolFrom(db)
	if err != nil {
		err = fmt.Errorf("park: NewStore: db is nil; pass postgres.From(pool) of an open *sql.DB or *pgxpool.Pool: %w", err)
	}
	return &Store{pool: pool, err: err}
}

// Filter selects parked keys; the zero Filter selects all.
type Filter struct {
	// Handler and Key, when not "", select one handler's keys, one key
	// (with Keyless, the lane of the message without a key whose UUID is
	// Key).
	Handler, Key string
	Keyless      bool
	// Limit caps the keys; 0 is no cap.
	Limit int
}

// List returns the parked keys f selects, held ones first, then by due
// time.
func (s *Store) List(ctx context.Context, f Filter) ([]Key, error) {
	if s.err != nil {
		return nil, s.err
	}
	lane := ""
	if f.Key != "" {
		lane = storage.ParkLane(f.Key, f.Keyless)
	}
	rows, err := storage.ListParked(ctx, s.pool, f.Handler, lane, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("park: listing parked keys%s: %w", storage.Hint(err), err)
	}
	out := make([]Key, 0, len(rows))
	for _, r := range rows {
		key, keyless := storage.SplitParkLane(r.Key)
		out = append(out, Key{Handler: r.Handler, Key: key, Keyless: keyless, Messages: r.Messages, DueAt: r.DueAt, Held: r.Held,
			Attempts: r.Attempts, Rounds: r.Rounds, FirstFailure: r.FirstFailure.Time, LastFailure: r.LastFailure.Time,
			LastError: r.LastError, DeadLetterID: r.DeadLetterID.Int64, ParkedSince: r.CreatedAt})
	}
	return out, nil
}

// lane is k's lane in the tables.
func (k Key) lane() string { return storage.ParkLane(k.Key, k.Keyless) }

// String names k as errors and the CLI show it: the key quoted as Go
// quotes it (a binary key's bytes escaped), or the keyless message.
func (k Key) String() string {
	if k.Keyless {
		return fmt.Sprintf("(no key: message %q) of handler %q", k.Key, k.Handler)
	}
	return fmt.Sprintf("key %q of handler %q", k.Key, k.Handler)
}

// Messages returns the parked messages of one key, in order.
func (s *Store) Messages(ctx context.Context, handler, key string) ([]Message, error) {
	return s.KeyMessages(ctx, Key{Handler: handler, Key: key})
}

// KeyMessages returns the parked messages of k (a Key from List, keyed or
// keyless), in order.
func (s *Store) KeyMessages(ctx context.Context, k Key) ([]Message, error) {
	if s.err != nil {
		return nil, s.err
	}
	rows, err := storage.ListParkedMessages(ctx, s.pool, k.Handler, k.lane())
	if err != nil {
		return nil, fmt.Errorf("park: listing the parked messages of %s: %w", k, err)
	}
	out := make([]Message, 0, len(rows))
	for _, r := range rows {
		md, err := storage.DecodeParkedMetadata(r.Metadata)
		if err != nil {
			return nil, fmt.Errorf("park: parked message %d of %s: %w", r.ID, k, err)
		}
		out = append(out, Message{ID: r.ID, UUID: r.MessageUUID, Topic: r.Topic, Payload: r.Payload, Metadata: md,
			DeadLetterID: r.DeadLetterID, ParkedAt: r.ParkedAt})
	}
	return out, nil
}

// Release drops a held key's head (its dead letter stays in the DLQ for
// `millwright dlq replay`) and makes its next message due at once, or
// releases the key when none is left. force also drops the head of a key
// that is not held (a message that never reached the DLQ: it is lost).
func (s *Store) Release(ctx context.Context, handler, key string, force bool) error {
	return s.ReleaseKey(ctx, Key{Handler: handler, Key: key}, force)
}

// ReleaseKey is Release of k (a Key from List, keyed or keyless).
func (s *Store) ReleaseKey(ctx context.Context, k Key, force bool) error {
	if s.err != nil {
		return s.err
	}
	return s.inTx(ctx, func(tx postgres.Tx) error { return ReleaseTx(ctx, tx, k, force) })
}

// ReleaseTx is Release of k in tx, the caller's transaction: the caller's
// audit row (audit.RecordTx) commits with it. `millwright parked release`
// and Store.Release call it.
func ReleaseTx(ctx context.Context, tx postgres.Tx, k Key, force bool) error {
	q, err := storage.FromTx(tx)
	if err != nil {
		return fmt.Errorf("park: ReleaseTx: %w", err)
	}
	err = storage.DropParkedHead(ctx, q, k.Handler, k.lane(), force, nil)
	if errors.Is(err, storage.ErrParkedClaimLost) {
		what := "parked"
		if !force {
			what = "held"
		}
		return fmt.Errorf("park: %s is not %s (see `millwright parked list`): %w", k, what, ErrNotParked)
	}
	return err
}

// SkipOptions are SkipTx's options.
type SkipOptions struct {
	// ConsumerGroup is the consumer group of the key's handler
	// (park.Config.ConsumerGroup), recorded on the dead letter of a head
	// that had none, so that its replay is for that consumer. Default "":
	// the dead letter names no consumer, and a replay of it goes to every
	// consumer group of its topic.
	ConsumerGroup string
	// DeadLetterTopic is recorded on that dead letter. Default: the
	// head's topic's dlq.DefaultTopic.
	DeadLetterTopic string
}

// Skip is SkipTx in a transaction of the Store's own.
func (s *Store) Skip(ctx context.Context, k Key, opts SkipOptions) (deadLetterID int64, err error) {
	if s.err != nil {
		return 0, s.err
	}
	err = s.inTx(ctx, func(tx postgres.Tx) error {
		deadLetterID, err = SkipTx(ctx, tx, k, opts)
		return err
	})
	return deadLetterID, err
}

// SkipTx drops k's head and goes on with the key's next message, like
// release, but never loses the head: a head that has no dead letter yet
// (a key not held, still being retried) is dead-lettered first
// (dlq.RecordTx, reason dlq.ReasonSkipped), in tx, so it stays in the DLQ
// for a later replay. It returns the head's dead letter id. A held key's
// head already has one: SkipTx is then ReleaseTx. ErrNotParked when the
// key is not parked.
func SkipTx(ctx context.Context, tx postgres.Tx, k Key, opts SkipOptions) (deadLetterID int64, err error) {
	q, err := storage.FromTx(tx)
	if err != nil {
		return 0, fmt.Errorf("park: SkipTx: %w", err)
	}
	err = storage.DropParkedHead(ctx, q, k.Handler, k.lane(), true, func(head storage.ParkedMessage) error {
		keys, err := storage.ListParked(ctx, q, k.Handler, k.lane(), 1)
		if err != nil {
			return err
		}
		switch {
		case head.DeadLetterID != 0:
			deadLetterID = head.DeadLetterID
			return nil
		case len(keys) == 1 && keys[0].Held && keys[0].DeadLetterID.Valid:
			deadLetterID = keys[0].DeadLetterID.Int64 // the held head's
			return nil
		}
		d, err := skippedDeadLetter(keys, k, head, opts)
		if err != nil {
			return err
		}
		id, err := dlq.RecordTx(ctx, tx, d)
		if err != nil {
			return err
		}
		if id == 0 {
			return fmt.Errorf("park: skipping %s: its head's dead letter (message %q) was recorded before, but the head does not name it: release it (`millwright parked release --force`) after checking `millwright dlq list`", k, head.MessageUUID)
		}
		deadLetterID = id
		return nil
	})
	if errors.Is(err, storage.ErrParkedClaimLost) {
		return 0, fmt.Errorf("park: %s is not parked (see `millwright parked list`): %w", k, ErrNotParked)
	}
	if err != nil {
		return 0, fmt.Errorf("park: skipping %s: %w", k, err)
	}
	return deadLetterID, nil
}

// skippedDeadLetter is the dead letter of head, skipped by an operator:
// the key's failure state (attempts, times, last error) and the message
// byte for byte.
func skippedDeadLetter(keys []storage.ParkedKey, k Key, head storage.ParkedMessage, opts SkipOptions) (dlq.DeadLetter, error) {
	md, err := storage.DecodeParkedMetadata(head.Metadata)
	if err != nil {
		return dlq.DeadLetter{}, fmt.Errorf("parked message %d: %w", head.ID, err)
	}
	d := dlq.DeadLetter{
		MessageUUID: head.MessageUUID, OriginalTopic: head.Topic, DeadLetterTopic: opts.DeadLetterTopic,
		ConsumerGroup: opts.ConsumerGroup, Handler: k.Handler, Reason: dlq.ReasonSkipped,
		Payload: head.Payload, Metadata: md, LastFailure: time.Now(),
	}
	if d.DeadLetterTopic == "" {
		d.DeadLetterTopic = dlq.DefaultTopic(head.Topic)
	}
	if len(keys) == 1 {
		st := keys[0]
		d.Attempts, d.Error = st.Attempts, st.LastError
		d.FirstFailure, d.LastFailure = st.FirstFailure.Time, st.LastFailure.Time
		if !st.LastFailure.Valid {
			d.LastFailure = time.Now()
		}
	}
	if d.Error == "" {
		d.Error = "skipped by an operator before it failed"
	}
	return d, nil
}

// inTx runs fn in a transaction of the Store's pool.
func (s *Store) inTx(ctx context.Context, fn func(postgres.Tx) error) error {
	tx, err := s.pool.Begin(ctx, storage.TxOptions{})
	if err != nil {
		return fmt.Errorf("park: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if err := fn(storage.TxOf(tx)); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// Retry makes a parked key's head due at once with a fresh budget, held or
// not: after the cause of its failures was fixed. When the head is then
// applied, its dead letter (if it has one) is resolved (dlq.ResolveTx).
// A key whose head a retrier's round is running now is left to that
// round: its lease is not cut short (no second round runs beside it), and
// the round's outcome decides what comes next.
func (s *Store) Retry(ctx context.Context, handler, key string) error {
	return s.RetryKey(ctx, Key{Handler: handler, Key: key})
}

// RetryKey is Retry of k (a Key from List, keyed or keyless).
func (s *Store) RetryKey(ctx context.Context, k Key) error {
	if s.err != nil {
		return s.err
	}
	return s.inTx(ctx, func(tx postgres.Tx) error { return RetryTx(ctx, tx, k) })
}

// RetryTx is Retry of k in tx, the caller's transaction: the caller's
// audit row (audit.RecordTx) commits with it. `millwright parked retry`
// and Store.Retry call it.
func RetryTx(ctx context.Context, tx postgres.Tx, k Key) error {
	q, err := storage.FromTx(tx)
	if err != nil {
		return fmt.Errorf("park: RetryTx: %w", err)
	}
	err = storage.RetryParked(ctx, q, k.Handler, k.lane())
	if errors.Is(err, storage.ErrParkedClaimLost) {
		return fmt.Errorf("park: %s is not parked (see `millwright parked list`): %w", k, ErrNotParked)
	}
	return err
}

// Depth is one handler's parked keys, messages and held keys.
type Depth struct{ Keys, Messages, Held int64 }

// Depths returns the parked keys, messages and held keys by handler.
func (s *Store) Depths(ctx context.Context) (map[string]Depth, error) {
	if s.err != nil {
		return nil, s.err
	}
	d, err := storage.ParkedDepths(ctx, s.pool)
	if err != nil {
		return nil, fmt.Errorf("park: measuring parked keys: %w", err)
	}
	out := make(map[string]Depth, len(d))
	for h, v := range d {
		out[h] = Depth{Keys: v.Keys, Messages: v.Messages, Held: v.Held}
	}
	return out, nil
}

// NewCollector returns a Prometheus collector of MetricParkedKeys,
// MetricParkedMessages and MetricHeldKeys by handler, queried from the
// store at each scrape (5 s timeout; a failed query is reported to the
// scraper as invalid metrics, not as zero). Register it once per process.
func NewCollector(s *Store) prometheus.Collector {
	return &collector{store: s,
		keys:     prometheus.NewDesc(MetricParkedKeys, "Parked keys (millwright_parked_keys), by handler.", []string{"handler"}, nil),
		messages: prometheus.NewDesc(MetricParkedMessages, "Parked messages (millwright_parked_messages), by handler.", []string{"handler"}, nil),
		held:     prometheus.NewDesc(MetricHeldKeys, "Parked keys held after a dead letter, waiting for an operator, by handler.", []string{"handler"}, nil),
	}
}

type collector struct {
	store                *Store
	keys, messages, held *prometheus.Desc
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.keys
	ch <- c.messages
	ch <- c.held
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	d, err := c.store.Depths(ctx)
	if err != nil {
		for _, desc := range []*prometheus.Desc{c.keys, c.messages, c.held} {
			ch <- prometheus.NewInvalidMetric(desc, err)
		}
		return
	}
	for h, v := range d {
		ch <- prometheus.MustNewConstMetric(c.keys, prometheus.GaugeValue, float64(v.Keys), h)
		ch <- prometheus.MustNewConstMetric(c.messages, prometheus.GaugeValue, float64(v.Messages), h)
		ch <- prometheus.MustNewConstMetric(c.held, prometheus.GaugeValue, float64(v.Held), h)
	}
}
