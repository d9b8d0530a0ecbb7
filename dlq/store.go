package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/postgres"
)

// ErrNotFound is returned by Store.Get when no dead letter has the id.
var ErrNotFound = errors.New("dead letter not found")

// DeadLetter is one row of millwright_dead_letters.
type DeadLetter struct {
	// ID is the row id, used by `millwright dlq show ID` and replay.
	ID int64
	// MessageUUID is the Watermill UUID of the original message, byte for
	// byte (a Go string holds any bytes; print it quoted, %q, when it may
	// not be text).
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
	// Metadata is the original metadata, without the dead-letter keys,
	// byte for byte: a binary Kafka key or header keeps its bytes (dlq
	// migration 005; a row recorded before it has what its text kept).
	Metadata map[string]string
	// CreatedAt is when the row was recorded.
	CreatedAt time.Time
	// ReplayedAt is when it was last replayed; nil if never.
	ReplayedAt *time.Time
	// ReplayCount counts replays.
	ReplayCount int
	// State is StateDead, StateReplayed, StateSuperseded or StateResolved.
	State string
	// SupersededBy is the event id of the edited copy that replaced a
	// superseded dead letter, SupersededActor who edited it (or who
	// replayed it, for a replayed one).
	SupersededBy, SupersededActor string
	// Fingerprint is the failure's cause (Fingerprint of Handler,
	// ErrorType and Error), stored by RecordTx; computed when read for a
	// row recorded before dlq migration 006.
	Fingerprint string
}

// The states of a dead letter (migrations 003 and 004). A superseded one
// was replaced by an edited copy (the operator console's edit and replay)
// and is never replayed again, not even with ReplayOptions.Force. A
// resolved one was applied later through package park (ResolveTx): it is
// no longer counted dead nor replayed unless forced.
const (
	StateDead       = "dead"
	StateReplayed   = "replayed"
	StateSuperseded = "superseded"
	StateResolved   = "resolved"
)

// Resolution says who applied a dead letter's message, for its audit row.
type Resolution struct {
	// Actor is who applied it: an operator's name, or the component (for
	// park's retrier "park retrier/<handler>"). Required.
	Actor string
	// Host is where it ran. Default: this machine's hostname.
	Host string
	// Args describe how (for park: the handler and key). Secrets are
	// redacted.
	Args []string
}

// ResolveCommand is the audit row's command of ResolveTx.
const ResolveCommand = "park resolve dead letter"

// ErrNotAudited is returned (wrapped) by ResolveTx, before it changes
// anything, when the millwright_audit table is missing: a resolution is
// always audited. Run `millwright migrate`.
var ErrNotAudited = errors.New("dlq: the resolution of a dead letter is audited, but millwright_audit does not exist: run `millwright migrate`")

// ResolveTx marks dead letter id resolved, in tx, with an audit row in
// the same transaction: its message was applied later (park's retrier
// after `millwright parked retry`, or a replay that took its place). It
// is the one operation that resolves a dead letter; park calls it in the
// transaction that removes the applied message. resolved is false (and
// nothing is written) when the row is not dead: replayed, superseded or
// resolved before, or gone.
func ResolveTx(ctx context.Context, tx postgres.Tx, id int64, r Resolution) (resolved bool, err error) {
	if r.Actor == "" {
		return false, errors.New("dlq: ResolveTx: Resolution.Actor is empty: name who applied the message")
	}
	q, err := storage.FromTx(tx)
	if err != nil {
		return false, fmt.Errorf("dlq: ResolveTx: %w", err)
	}
	if err := audit.Ready(ctx, tx); errors.Is(err, audit.ErrNotMigrated) {
		return false, fmt.Errorf("%w (dead letter %d stays dead)", ErrNotAudited, id)
	} else if err != nil {
		return false, fmt.Errorf("dlq: resolving dead letter %d: %w", id, err)
	}
	if resolved, err = storage.ResolveDeadLetter(ctx, q, id, r.Actor); err != nil || !resolved {
		if err != nil {
			err = fmt.Errorf("dlq: resolving dead letter %d (did `millwright migrate` run?): %w", id, err)
		}
		return false, err
	}
	args := append([]string{"--id=" + strconv.FormatInt(id, 10)}, r.Args...)
	by := audit.Operator{User: r.Actor, Host: r.Host, Confirmed: "applied"}
	if _, err := audit.RecordTx(ctx, tx, by.Entry(ResolveCommand, args, 1)); err != nil {
		return false, fmt.Errorf("dlq: auditing the resolution of dead letter %d: %w", id, err)
	}
	return true, nil
}

// Store keeps dead letters in Postgres for inspection and replay, on a
// *sql.DB or a *pgxpool.Pool. It is safe for concurrent use. The table
// comes from Migrations.
type Store struct {
	pool storage.Pool
	// err is NewStore's: a nil pool. Every method returns it.
	err error
}

// NewStore returns a Store on db, a *sql.DB (lib/pq, or pgx's stdlib
// adapter) or a *pgxpool.Pool, whose search_path must reach the
// millwright_dead_letters table. A nil db gives a Store whose every method
// fails saying so.
func NewStore(db postgres.DB) *Store {
	pool, err := storage.PoolFrom(db)
	if err != nil {
		err = fmt.Errorf("dlq: NewStore: db is nil; pass postgres.From(pool) of an open *sql.DB or *pgxpool.Pool: %w", err)
	}
	return &Store{pool: pool, err: err}
}

// Record stores a dead letter consumed from a dead-letter topic. Its
// signature is message.NoPublishHandlerFunc, so it is a router handler:
//
//	router.AddConsumerHandler("dlq-recorder", "orders.dlq", sub, store.Record)
//
// It is idempotent: a redelivered dead letter (same dead-letter topic, UUID
// and last failure time) is stored once. A message without the dead-letter
// keys is stored too, with what is known, rather than dropped. Values
// Postgres refuses are made storable (see parseEnvelope); a row refused
// all the same (a data error: a column altered by hand, say) is a
// failure.Permanent error naming the value, since a redelivery would be
// refused again, and never "did migrate run?".
func (s *Store) Record(msg *message.Message) error {
	_, err := s.Insert(msg.Context(), msg)
	return err
}

// Insert stores msg like Record and returns the row id, or 0 when the row
// already existed.
func (s *Store) Insert(ctx context.Context, msg *message.Message) (int64, error) {
	if s.err != nil {
		return 0, s.err
	}
	dlTopic := msg.Metadata.Get(metadata.DeadLetterTopic)
	if dlTopic == "" {
		dlTopic = message.SubscribeTopicFromCtx(ctx)
	}
	r, err := parseEnvelope(msg, dlTopic, time.Now())
	if err != nil {
		return 0, err
	}
	return record(ctx, s.pool, r)
}

// RecordTx writes dead letter d in tx, the transaction of the state change
// that gave up on its message (package park's, holding the message's key
// behind it), and returns its id, or 0 when the same dead letter (its
// DeadLetterTopic, MessageUUID and LastFailure) was recorded before. It is
// the one writer of millwright_dead_letters: Store.Record (the dead-letter
// topics' recorder) goes through the same code, so every row has the same
// fields filled the same way. ID, CreatedAt, the replay fields and State
// are ignored (a new row is dead). Text Postgres refuses is stored with
// U+FFFD in the text columns, the UUID and metadata (without the
// dead-letter keys, which the columns hold) byte for byte beside them;
// Attempts is clamped to 0..2^31-1; a zero or unstorable
// FirstFailure is now, a LastFailure likewise the first failure.
func RecordTx(ctx context.Context, tx postgres.Tx, d DeadLetter) (int64, error) {
	q, err := storage.FromTx(tx)
	if err != nil {
		return 0, fmt.Errorf("dlq: RecordTx: %w", err)
	}
	r, err := newEnvelope(d, time.Now())
	if err != nil {
		return 0, err
	}
	return record(ctx, q, r)
}

// newEnvelope is d made storable, as parseEnvelope makes a message.
func newEnvelope(d DeadLetter, now time.Time) (envelope, error) {
	r := envelope{DeadLetter: DeadLetter{
		MessageUUID: d.MessageUUID, OriginalTopic: storable(d.OriginalTopic), DeadLetterTopic: storable(d.DeadLetterTopic),
		ConsumerGroup: storable(d.ConsumerGroup), Handler: storable(d.Handler), Reason: storable(d.Reason),
		Error: storable(d.Error), ErrorType: storable(d.ErrorType), Stack: storable(d.Stack),
		Attempts: min(max(d.Attempts, 0), maxAttempts), Payload: d.Payload, Metadata: map[string]string{},
	}}
	r.FirstFailure = d.FirstFailure
	if r.FirstFailure.IsZero() || storage.CheckTime(r.FirstFailure) != nil {
		r.FirstFailure = now
	}
	r.LastFailure = d.LastFailure
	if r.LastFailure.IsZero() || storage.CheckTime(r.LastFailure) != nil {
		r.LastFailure = r.FirstFailure
	}
	asText := map[string]string{}
	for k, v := range d.Metadata {
		if !isDeadLetterKey(k) { // as parseEnvelope: the envelope is in the columns
			r.Metadata[k] = v
			asText[storable(k)] = storable(v)
		}
	}
	b, err := json.Marshal(asText)
	if err != nil {
		return r, fmt.Errorf("dlq: encoding metadata of dead letter %q: %w", r.MessageUUID, err)
	}
	r.metadataJSON = string(b)
	if r.Payload == nil {
		r.Payload = []byte{}
	}
	return r, nil
}

// record inserts r through q.
func record(ctx context.Context, q storage.Querier, r envelope) (int64, error) {
	id, err := storage.InsertDeadLetter(ctx, q, r.row())
	if storage.IsDataError(err) {
		// The envelope makes every value storable; a row refused all the
		// same (a column changed by hand, say) is refused again at every
		// redelivery: permanent, so that a retry policy around the
		// recorder stops at once, and named, not "did migrate run?".
		return 0, failure.Permanent(fmt.Errorf("dlq: dead letter %q from %s cannot be stored: the table refuses a value it carries, and a redelivery carries the same: %w", r.MessageUUID, r.DeadLetterTopic, err))
	}
	if err != nil {
		return 0, fmt.Errorf("dlq: recording dead letter %q from %s%s: %w", r.MessageUUID, r.DeadLetterTopic, storage.Hint(err), err)
	}
	return id, nil
}

// row is the envelope as the storage layer writes it: the UUID and the
// metadata byte for byte (message_uuid_raw, metadata_raw: what a replay
// publishes), and as text for searches (message_uuid, metadata).
func (r envelope) row() storage.DeadLetterRow {
	return storage.DeadLetterRow{
		MessageUUID: storable(r.MessageUUID), MessageUUIDRaw: r.MessageUUID, MetadataRaw: storage.EncodeParkedMetadata(r.Metadata),
		OriginalTopic: r.OriginalTopic, DLQTopic: r.DeadLetterTopic,
		ConsumerGroup: r.ConsumerGroup, Handler: r.Handler, Reason: r.Reason, Error: r.Error,
		ErrorType: r.ErrorType, Stack: r.Stack, Attempts: r.Attempts, FirstFailure: r.FirstFailure,
		LastFailure: r.LastFailure, Payload: r.Payload, Metadata: r.metadataJSON,
		Fingerprint: Fingerprint(r.Handler, r.ErrorType, r.Error),
	}
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
// forever: the message's UUID, payload and metadata are kept byte for byte
// (a replay publishes them as they came); in the text columns (the
// dead-letter keys, and the UUID and metadata as searches read them) text
// Postgres refuses (invalid UTF-8, NUL bytes, also inside the metadata
// JSON) is stored with U+FFFD in place of the bad bytes; an
// attempts value that is not a number in 0..2^31-1 is stored as 0 or
// clamped; a time that is not RFC 3339 becomes now (first failure) or the
// first failure (last failure). Every RFC 3339 time is stored as its
// instant (year 0000 is 1 BC; any offset, +23:59 too, on either driver).
func parseEnvelope(msg *message.Message, dlTopic string, now time.Time) (envelope, error) {
	md := msg.Metadata
	var r envelope
	r.MessageUUID = msg.UUID
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
	asText := map[string]string{}
	for k, v := range md {
		if !isDeadLetterKey(k) {
			r.Metadata[k] = v
			asText[storable(k)] = storable(v)
		}
	}
	b, err := json.Marshal(asText)
	if err != nil {
		return r, fmt.Errorf("dlq: encoding metadata of dead letter %q: %w", r.MessageUUID, err)
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
	if err != nil || storage.CheckTime(t) != nil {
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
	// ErrorType selects one error type (DeadLetter.ErrorType).
	ErrorType string
	// ErrorContains selects rows whose error contains this text, ignoring case.
	ErrorContains string
	// Pending selects only rows still dead: never replayed, superseded or
	// resolved.
	Pending bool
	// Fingerprint selects one cause (DeadLetter.Fingerprint, Causes).
	Fingerprint string
	// Limit caps the number of rows, oldest first. 0 means no limit.
	Limit int

	// afterID selects rows with a larger id: Replay's keyset paging.
	afterID int64
	// maxID, when not 0, selects rows with an id up to it: a bulk
	// action's bound.
	maxID int64
}

// selection is f as the storage layer reads it.
func (f Filter) selection() storage.DeadLetterFilter {
	return storage.DeadLetterFilter{
		IDs: f.IDs, Topic: f.Topic, Since: f.Since, Until: f.Until, ErrorType: f.ErrorType, ErrorContains: f.ErrorContains,
		Pending: f.Pending, AfterID: f.afterID, MaxID: f.maxID, Limit: f.Limit, Fingerprint: f.Fingerprint,
	}
}

// deadLetter decodes a row: its UUID and metadata from their lossless
// copies.
func deadLetter(r storage.DeadLetterRow) (DeadLetter, error) {
	d := DeadLetter{
		ID: r.ID, MessageUUID: r.MessageUUIDRaw, OriginalTopic: r.OriginalTopic, DeadLetterTopic: r.DLQTopic,
		ConsumerGroup: r.ConsumerGroup, Handler: r.Handler, Reason: r.Reason, Error: r.Error,
		ErrorType: r.ErrorType, Stack: r.Stack, Attempts: r.Attempts, FirstFailure: r.FirstFailure,
		LastFailure: r.LastFailure, Payload: r.Payload, CreatedAt: r.CreatedAt, ReplayedAt: r.ReplayedAt,
		ReplayCount: r.ReplayCount, State: r.State, SupersededBy: r.SupersededBy, SupersededActor: r.SupersededActor,
		Fingerprint: r.Fingerprint,
	}
	if d.Fingerprint == "" {
		d.Fingerprint = Fingerprint(d.Handler, d.ErrorType, d.Error)
	}
	md, err := r.MetadataMap()
	if err != nil {
		return d, fmt.Errorf("dlq: decoding metadata: %w", err)
	}
	d.Metadata = md
	return d, nil
}

// List returns the dead letters f selects, oldest first (by id).
func (s *Store) List(ctx context.Context, f Filter) ([]DeadLetter, error) {
	if s.err != nil {
		return nil, s.err
	}
	return list(ctx, s.pool, f)
}

// List is Store.List on db, or in the caller's transaction (the operator
// console's, with its SET LOCAL search_path).
func List(ctx context.Context, db postgres.Handle, f Filter) ([]DeadLetter, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("dlq: List: %w", err)
	}
	return list(ctx, q, f)
}

func list(ctx context.Context, q storage.Querier, f Filter) ([]DeadLetter, error) {
	sel, err := resolveSelection(ctx, q, f)
	if err != nil {
		return nil, err
	}
	rows, err := storage.ListDeadLetters(ctx, q, sel)
	if err != nil {
		return nil, fmt.Errorf("dlq: listing dead letters%s: %w", storage.Hint(err), err)
	}
	out := make([]DeadLetter, 0, len(rows))
	for _, r := range rows {
		d, err := deadLetter(r)
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}

// Count returns how many dead letters f selects, ignoring f.Limit.
func (s *Store) Count(ctx context.Context, f Filter) (int, error) {
	if s.err != nil {
		return 0, s.err
	}
	return count(ctx, s.pool, f)
}

// Count is Store.Count on db, or in the caller's transaction.
func Count(ctx context.Context, db postgres.Handle, f Filter) (int, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return 0, fmt.Errorf("dlq: Count: %w", err)
	}
	return count(ctx, q, f)
}

func count(ctx context.Context, q storage.Querier, f Filter) (int, error) {
	sel, err := resolveSelection(ctx, q, f)
	if err != nil {
		return 0, err
	}
	n, err := storage.CountDeadLetters(ctx, q, sel)
	if err != nil {
		return 0, fmt.Errorf("dlq: counting dead letters%s: %w", storage.Hint(err), err)
	}
	return n, nil
}

// Get returns one dead letter, or an error wrapping ErrNotFound.
func (s *Store) Get(ctx context.Context, id int64) (DeadLetter, error) {
	if s.err != nil {
		return DeadLetter{}, s.err
	}
	return get(ctx, s.pool, id)
}

// Get is Store.Get on db, or in the caller's transaction.
func Get(ctx context.Context, db postgres.Handle, id int64) (DeadLetter, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return DeadLetter{}, fmt.Errorf("dlq: Get: %w", err)
	}
	return get(ctx, q, id)
}

func get(ctx context.Context, q storage.Querier, id int64) (DeadLetter, error) {
	r, err := storage.GetDeadLetter(ctx, q, id)
	if storage.IsNoRows(err) {
		return DeadLetter{}, fmt.Errorf("dlq: dead letter %d: %w (see `millwright dlq list`)", id, ErrNotFound)
	}
	if err != nil {
		return DeadLetter{}, fmt.Errorf("dlq: reading dead letter %d%s: %w", id, storage.Hint(err), err)
	}
	return deadLetter(r)
}

// Group is the dead letters of one original topic and error type.
type Group struct {
	Topic, ErrorType string
	// Count counts the rows; Dead those still in the dead state.
	Count, Dead int64
	// FirstSeen and LastSeen bound their last failures.
	FirstSeen, LastSeen time.Time
	// SampleError is the error of the newest row.
	SampleError string
}

// Groups returns the dead letters f selects (its Topic, ErrorContains and
// Pending) grouped by original topic and error type, by topic then error
// type: the operator console's summary, in its transaction.
func Groups(ctx context.Context, db postgres.Handle, f Filter) ([]Group, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("dlq: Groups: %w", err)
	}
	gs, err := storage.GroupDeadLetters(ctx, q, f.selection())
	if err != nil {
		return nil, fmt.Errorf("dlq: grouping dead letters%s: %w", storage.Hint(err), err)
	}
	out := make([]Group, len(gs))
	for i, g := range gs {
		out[i] = Group(g)
	}
	return out, nil
}

// Depth returns the number of dead letters not yet replayed, by original
// topic.
func (s *Store) Depth(ctx context.Context) (map[string]int64, error) {
	if s.err != nil {
		return nil, s.err
	}
	out, err := storage.DeadLetterDepth(ctx, s.pool)
	if err != nil {
		return nil, fmt.Errorf("dlq: measuring depth: %w", err)
	}
	return out, nil
}
