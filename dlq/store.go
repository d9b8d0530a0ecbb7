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
	md := msg.Metadata
	now := time.Now()
	dlTopic := md.Get(metadata.DeadLetterTopic)
	if dlTopic == "" {
		dlTopic = message.SubscribeTopicFromCtx(ctx)
	}
	attempts, _ := strconv.Atoi(md.Get(metadata.DeadLetterAttempts))
	first := parseTime(md.Get(metadata.DeadLetterFirstFailure), now)
	last := parseTime(md.Get(metadata.DeadLetterLastFailure), first)
	orig := map[string]string{}
	for k, v := range md {
		if !isDeadLetterKey(k) {
			orig[k] = v
		}
	}
	mdJSON, err := json.Marshal(orig)
	if err != nil {
		return 0, fmt.Errorf("dlq: encoding metadata of dead letter %s: %w", msg.UUID, err)
	}
	payload := msg.Payload
	if payload == nil {
		payload = []byte{}
	}
	var id int64
	err = s.db.QueryRowContext(ctx, `
INSERT INTO millwright_dead_letters (message_uuid, original_topic, dlq_topic, consumer_group, handler,
    reason, error, error_type, stack, attempts, first_failure_at, last_failure_at, payload, metadata)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
ON CONFLICT (dlq_topic, message_uuid, last_failure_at) DO NOTHING
RETURNING id`,
		msg.UUID, md.Get(metadata.DeadLetterOriginalTopic), dlTopic, md.Get(metadata.DeadLetterConsumerGroup),
		md.Get(metadata.DeadLetterHandler), md.Get(metadata.DeadLetterReason), md.Get(metadata.DeadLetterError),
		md.Get(metadata.DeadLetterErrorType), md.Get(metadata.DeadLetterStack), attempts, first, last,
		payload, string(mdJSON)).Scan(&id)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("dlq: recording dead letter %s from %s (did `millwright migrate` run?): %w", msg.UUID, dlTopic, err)
	}
	return id, nil
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
