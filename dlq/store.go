package dlq

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/lib/pq"

	"github.com/millwright/millwright/metadata"
)

// ErrNotFound is returned by Store.Get when no dead letter has the id.
var ErrNotFound = errors.New("dead letter not found")

// DeadLetter is one row of millwright_dead_letters.
type DeadLetter struct {
	// ID is the row id, used by `millwright dlq show ID` and replay.
	ID int64
	// MessageUUID is the Watermill UUID of the original message.
	MessageUUID string
	// OriginalTopic is the topic the message was consumed from.
	OriginalTopic string
	// DeadLetterTopic is the topic it was parked on.
	DeadLetterTopic string
	// ConsumerGroup and Handler name the consumer that gave up.
	ConsumerGroup, Handler string
	// Reason is one of the Reason constants.
	Reason string
	// Error and ErrorType describe the last error; Stack is the panic's
	// stack, if it panicked. Error and Stack are as long as the middleware's
	// Config.MaxValueBytes let them be.
	Error, ErrorType, Stack string
	// Attempts counts the attempts made before parking.
	Attempts int
	// FirstFailure and LastFailure are when the first and last attempt failed.
	FirstFailure, LastFailure time.Time
	// Payload is the original payload.
	Payload []byte
	// Metadata is the original metadata, without the dead-letter keys.
	Metadata map[string]string
	// CreatedAt is when the row was recorded.
	CreatedAt time.Time
	// ReplayedAt is when it was last replayed; nil if never.
	ReplayedAt *time.Time
	// ReplayCount counts replays.
	ReplayCount int
}

// Store keeps dead letters in Postgres for inspection and replay. It is
// safe for concurrent use. The table comes from Migrations.
type Store struct {
	db *sql.DB
	// replayPage is how many rows Replay reads at a time; 0 means
	// defaultReplayPage. Tests set it small.
	replayPage int
}

// NewStore returns a Store on db, whose search_path must reach the
// millwright_dead_letters table.
func NewStore(db *sql.DB) *Store { return &Store{db: db} }

// Record stores a dead letter consumed from a dead-letter topic. Its
// signature is message.NoPublishHandlerFunc, so it is a router handler:
//
//	router.AddConsumerHandler("dlq-recorder", "orders.dlq", sub, store.Record)
//
// It is idempotent: a redelivered dead letter (same dead-letter topic, UUID
// and last failure time) is stored once. A message without the dead-letter
// keys is stored too, with what is known, rather than dropped.
func (s *Store) Record(msg *message.Message) error {
	_, err := s.Insert(msg.Context(), msg)
	return err
}

// Insert stores msg like Record and returns the row id, or 0 when the row
// already existed.
func (s *Store) Insert(ctx context.Context, msg *message.Message) (int64, error) {
	dlTopic := msg.Metadata.Get(metadata.DeadLetterTopic)
	if dlTopic == "" {
		dlTopic = message.SubscribeTopicFromCtx(ctx)
	}
	r, err := parseEnvelope(msg, dlTopic, time.Now())
	if err != nil {
		return 0, err
	}
	var id int64
	err = s.db.QueryRowContext(ctx, `
INSERT INTO millwright_dead_letters (message_uuid, original_topic, dlq_topic, consumer_group, handler,
    reason, error, error_type, stack, attempts, first_failure_at, last_failure_at, payload, metadata)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
ON CONFLICT (dlq_topic, message_uuid, last_failure_at) DO NOTHING
RETURNING id`,
		r.MessageUUID, r.OriginalTopic, r.DeadLetterTopic, r.ConsumerGroup, r.Handler, r.Reason, r.Error,
		r.ErrorType, r.Stack, r.Attempts, r.FirstFailure, r.LastFailure, r.Payload, r.metadataJSON).Scan(&id)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("dlq: recording dead letter %s from %s (did `millwright migrate` run?): %w", r.MessageUUID, r.DeadLetterTopic, err)
	}
	return id, nil
}

// envelope is a dead letter read from a message, ready to insert.
type envelope struct {
	DeadLetter
	metadataJSON string
}

// maxAttempts is the largest attempts value stored (the column is an int4).
const maxAttempts = 1<<31 - 1

// parseEnvelope reads the dead-letter metadata of msg. Whatever reaches
// the dead-letter topic is stored, since a refused row would be redelivered
// forever: text Postgres refuses (invalid UTF-8, NUL bytes, also inside
// the metadata JSON) is stored with U+FFFD in place of the bad bytes; an
// attempts value that is not a number in 0..2^31-1 is stored as 0 or
// clamped; a time that is not RFC 3339 becomes now (first failure) or the
// first failure (last failure). The payload is kept byte for byte.
func parseEnvelope(msg *message.Message, dlTopic string, now time.Time) (envelope, error) {
	md := msg.Metadata
	var r envelope
	r.MessageUUID = storable(msg.UUID)
	r.OriginalTopic = storable(md.Get(metadata.DeadLetterOriginalTopic))
	r.DeadLetterTopic = storable(dlTopic)
	r.ConsumerGroup = storable(md.Get(metadata.DeadLetterConsumerGroup))
	r.Handler = storable(md.Get(metadata.DeadLetterHandler))
	r.Reason = storable(md.Get(metadata.DeadLetterReason))
	r.Error = storable(md.Get(metadata.DeadLetterError))
	r.ErrorType = storable(md.Get(metadata.DeadLetterErrorType))
	r.Stack = storable(md.Get(metadata.DeadLetterStack))
	if n, err := strconv.ParseInt(strings.TrimSpace(md.Get(metadata.DeadLetterAttempts)), 10, 64); err == nil && n > 0 {
		r.Attempts = int(min(n, maxAttempts))
	}
	r.FirstFailure = parseTime(md.Get(metadata.DeadLetterFirstFailure), now)
	r.LastFailure = parseTime(md.Get(metadata.DeadLetterLastFailure), r.FirstFailure)
	r.Metadata = map[string]string{}
	for k, v := range md {
		if !isDeadLetterKey(k) {
			r.Metadata[storable(k)] = storable(v)
		}
	}
	b, err := json.Marshal(r.Metadata)
	if err != nil {
		return r, fmt.Errorf("dlq: encoding metadata of dead letter %s: %w", r.MessageUUID, err)
	}
	r.metadataJSON = string(b)
	r.Payload = msg.Payload
	if r.Payload == nil {
		r.Payload = []byte{}
	}
	return r, nil
}

// storable returns s as text Postgres accepts: valid UTF-8 without NUL.
func storable(s string) string {
	if utf8.ValidString(s) && !strings.ContainsRune(s, 0) {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

func parseTime(s string, def time.Time) time.Time {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return def
	}
	return t
}

// Filter selects dead letters. The zero Filter selects every row.
type Filter struct {
	// IDs, when not empty, selects only these rows.
	IDs []int64
	// Topic selects one original topic.
	Topic string
	// Since and Until bound the last failure time: Since <= t < Until. Zero
	// means unbounded.
	Since, Until time.Time
	// ErrorContains selects rows whose error contains this text, ignoring case.
	ErrorContains string
	// Pending selects only rows never replayed.
	Pending bool
	// Limit caps the number of rows, oldest first. 0 means no limit.
	Limit int

	// afterID selects rows with a larger id: Replay's keyset paging.
	afterID int64
}

// where returns the WHERE clause and its arguments.
func (f Filter) where() (string, []any) {
	var (
		conds []string
		args  []any
	)
	add := func(cond string, arg any) {
		args = append(args, arg)
		conds = append(conds, strings.ReplaceAll(cond, "?", "$"+strconv.Itoa(len(args))))
	}
	if len(f.IDs) > 0 {
		add("id = ANY(?)", pq.Array(f.IDs))
	}
	if f.Topic != "" {
		add("original_topic = ?", f.Topic)
	}
	if !f.Since.IsZero() {
		add("last_failure_at >= ?", f.Since)
	}
	if !f.Until.IsZero() {
		add("last_failure_at < ?", f.Until)
	}
	if f.ErrorContains != "" {
		add("strpos(lower(error), lower(?)) > 0", f.ErrorContains)
	}
	if f.Pending {
		conds = append(conds, "replayed_at IS NULL")
	}
	if f.afterID > 0 {
		add("id > ?", f.afterID)
	}
	if len(conds) == 0 {
		return "", nil
	}
	return " WHERE " + strings.Join(conds, " AND "), args
}

const columns = `id, message_uuid, original_topic, dlq_topic, consumer_group, handler, reason, error, error_type,
    stack, attempts, first_failure_at, last_failure_at, payload, metadata, created_at, replayed_at, replay_count`

type rowScanner interface{ Scan(dest ...any) error }

func scanDeadLetter(r rowScanner) (DeadLetter, error) {
	var (
		d        DeadLetter
		mdJSON   []byte
		replayed sql.NullTime
	)
	err := r.Scan(&d.ID, &d.MessageUUID, &d.OriginalTopic, &d.DeadLetterTopic, &d.ConsumerGroup, &d.Handler,
		&d.Reason, &d.Error, &d.ErrorType, &d.Stack, &d.Attempts, &d.FirstFailure, &d.LastFailure, &d.Payload,
		&mdJSON, &d.CreatedAt, &replayed, &d.ReplayCount)
	if err != nil {
		return d, err
	}
	if replayed.Valid {
		t := replayed.Time
		d.ReplayedAt = &t
	}
	if err := json.Unmarshal(mdJSON, &d.Metadata); err != nil {
		return d, fmt.Errorf("dlq: decoding metadata of dead letter %d: %w", d.ID, err)
	}
	return d, nil
}

// List returns the dead letters f selects, oldest first (by id).
func (s *Store) List(ctx context.Context, f Filter) ([]DeadLetter, error) {
	where, args := f.where()
	q := "SELECT " + columns + " FROM millwright_dead_letters" + where + " ORDER BY id"
	if f.Limit > 0 {
		q += " LIMIT " + strconv.Itoa(f.Limit)
	}
	rows, err := s.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("dlq: listing dead letters (did `millwright migrate` run?): %w", err)
	}
	defer rows.Close()
	var out []DeadLetter
	for rows.Next() {
		d, err := scanDeadLetter(rows)
		if err != nil {
			return nil, fmt.Errorf("dlq: reading dead letter: %w", err)
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("dlq: listing dead letters: %w", err)
	}
	return out, nil
}

// Count returns how many dead letters f selects, ignoring f.Limit.
func (s *Store) Count(ctx context.Context, f Filter) (int, error) {
	where, args := f.where()
	var n int
	if err := s.db.QueryRowContext(ctx, "SELECT count(*) FROM millwright_dead_letters"+where, args...).Scan(&n); err != nil {
		return 0, fmt.Errorf("dlq: counting dead letters: %w", err)
	}
	return n, nil
}

// Get returns one dead letter, or an error wrapping ErrNotFound.
func (s *Store) Get(ctx context.Context, id int64) (DeadLetter, error) {
	d, err := scanDeadLetter(s.db.QueryRowContext(ctx, "SELECT "+columns+" FROM millwright_dead_letters WHERE id = $1", id))
	if errors.Is(err, sql.ErrNoRows) {
		return d, fmt.Errorf("dlq: dead letter %d: %w (see `millwright dlq list`)", id, ErrNotFound)
	}
	if err != nil {
		return d, fmt.Errorf("dlq: reading dead letter %d: %w", id, err)
	}
	return d, nil
}

// Depth returns the number of dead letters not yet replayed, by original
// topic.
func (s *Store) Depth(ctx context.Context) (map[string]int64, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT original_topic, count(*) FROM millwright_dead_letters WHERE replayed_at IS NULL GROUP BY original_topic`)
	if err != nil {
		return nil, fmt.Errorf("dlq: measuring depth: %w", err)
	}
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var (
			topic string
			n     int64
		)
		if err := rows.Scan(&topic, &n); err != nil {
			return nil, fmt.Errorf("dlq: measuring depth: %w", err)
		}
		out[topic] = n
	}
	return out, rows.Err()
}
