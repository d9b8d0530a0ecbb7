package storage

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/millwright/millwright/internal/fingerprint"
)

// Dead letters: millwright_dead_letters, one row per message a consumer
// gave up on, kept for inspection and replay.

// DeadLetterRow is one row of millwright_dead_letters.
type DeadLetterRow struct {
	ID                                   int64
	MessageUUID, OriginalTopic, DLQTopic string
	ConsumerGroup, Handler, Reason       string
	Error, ErrorType, Stack              string
	Attempts                             int
	FirstFailure, LastFailure            time.Time
	Payload                              []byte
	// Metadata is a JSON object of strings (the metadata column: text,
	// invalid UTF-8 and NUL shown as U+FFFD), what searches read.
	Metadata string
	// MessageUUIDRaw and MetadataRaw are the message's UUID and metadata
	// byte for byte (dlq migration 005; MetadataRaw in
	// EncodeParkedMetadata's form), what a replay publishes. Inserted, an
	// empty MessageUUIDRaw stores MessageUUID's bytes and a nil
	// MetadataRaw stores NULL. Read back, MessageUUIDRaw is always set (the
	// text's bytes for a row an older version wrote) and MetadataRaw is
	// nil when the row has none: Metadata is then its only copy (see
	// MetadataMap).
	MessageUUIDRaw string
	MetadataRaw    []byte
	CreatedAt      time.Time
	ReplayedAt     *time.Time
	ReplayCount    int
	// State is dead, replayed or superseded (dlq migration 003);
	// SupersededBy is the event id of the edited copy that replaced a
	// superseded row, SupersededActor who edited it.
	State, SupersededBy, SupersededActor string
	// Fingerprint is the failure's cause (fingerprint.Of of Handler,
	// ErrorType and Error; dlq migration 006). Inserted, "" stores the
	// one computed from the row; read back, "" is a row recorded before
	// the migration (or by an older version), NULL in the table.
	Fingerprint string
}

// Cause is the handler, error type and message of dead letters without a
// stored fingerprint: what their fingerprint is computed from.
type Cause struct{ Handler, ErrorType, Error string }

// DeadLetterFilter selects rows; the zero filter selects every row.
type DeadLetterFilter struct {
	// IDs, when not empty, selects only these rows.
	IDs []int64
	// Topic selects one original topic.
	Topic string
	// Since <= last failure < Until; zero is unbounded.
	Since, Until time.Time
	// ErrorContains selects rows whose error contains it, ignoring case.
	ErrorContains string
	// ErrorType selects one error type (the console's groups).
	ErrorType string
	// Pending selects rows still dead: never replayed, superseded or
	// resolved.
	Pending bool
	// Fingerprint selects one cause: the rows with that fingerprint, and
	// the rows without one (recorded before dlq migration 006) whose
	// handler, error type and error are one of Unfingerprinted.
	Fingerprint     string
	Unfingerprinted []Cause
	// AfterID selects rows with a larger id (keyset paging).
	AfterID int64
	// MaxID, when not 0, selects rows with an id up to it (a bulk
	// action's bound).
	MaxID int64
	// Limit caps the rows, by id; 0 is no cap.
	Limit int
}

const (
	insertDeadLetterSQL = `INSERT INTO millwright_dead_letters (message_uuid, original_topic, dlq_topic, consumer_group, handler,
    reason, error, error_type, stack, attempts, first_failure_at, last_failure_at, payload, metadata, message_uuid_raw, metadata_raw, fingerprint)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14::jsonb, $15, $16, $17)
ON CONFLICT (dlq_topic, message_uuid, last_failure_at) DO NOTHING
RETURNING id`
	deadLetterColumns = `id, message_uuid, original_topic, dlq_topic, consumer_group, handler, reason, error, error_type,
    stack, attempts, first_failure_at, last_failure_at, payload, metadata::text, created_at, replayed_at, replay_count,
    state, superseded_by, superseded_actor, ` + uuidRawColumn + `, metadata_raw IS NOT NULL, COALESCE(metadata_raw, ''::bytea),
    COALESCE(fingerprint, '')`
	// uuidRawColumn is the UUID's bytes, the text's for a row without them.
	uuidRawColumn     = `COALESCE(message_uuid_raw, convert_to(message_uuid, 'UTF8'))`
	lockDeadLetterSQL = `SELECT ` + deadLetterColumns + ` FROM millwright_dead_letters
WHERE id = $1 AND (state = 'dead' OR ($2 AND state NOT IN ('superseded', 'discarded'))) FOR UPDATE SKIP LOCKED`
	lockDeadLetterWaitSQL = `SELECT ` + deadLetterColumns + ` FROM millwright_dead_letters
WHERE id = $1 AND (state = 'dead' OR ($2 AND state NOT IN ('superseded', 'discarded'))) FOR UPDATE`
	deadLetterReplayedSQL = `UPDATE millwright_dead_letters SET replayed_at = now(), replay_count = replay_count + 1, state = 'replayed' WHERE id = $1`
	deadLetterDepthSQL    = `SELECT original_topic, count(*) FROM millwright_dead_letters WHERE state = 'dead' GROUP BY original_topic`
)

// InsertDeadLetter writes r (its ID, CreatedAt, ReplayedAt and ReplayCount
// are ignored) and returns its id, or 0 when the same dead letter (dead
// letter topic, message UUID, last failure) was stored before.
func InsertDeadLetter(ctx context.Context, q Querier, r DeadLetterRow) (int64, error) {
	md := r.Metadata
	if md == "" {
		md = "{}"
	}
	payload := r.Payload
	if payload == nil {
		payload = []byte{}
	}
	uuidRaw := r.MessageUUIDRaw
	if uuidRaw == "" {
		uuidRaw = r.MessageUUID
	}
	var mdRaw any // NULL unless given
	if r.MetadataRaw != nil {
		mdRaw = r.MetadataRaw
	}
	fp := r.Fingerprint
	if fp == "" {
		fp = fingerprint.Of(r.Handler, r.ErrorType, r.Error)
	}
	var id int64
	err := q.QueryRow(ctx, Statement{SQL: insertDeadLetterSQL, Args: []any{
		r.MessageUUID, r.OriginalTopic, r.DLQTopic, r.ConsumerGroup, r.Handler, r.Reason, r.Error,
		r.ErrorType, r.Stack, r.Attempts, r.FirstFailure, r.LastFailure, payload, md, []byte(uuidRaw), mdRaw, fp,
	}, Expect: NoExpect, What: "recording a dead letter"}, &id)
	if IsNoRows(err) {
		return 0, nil
	}
	return id, nameField(err, "message_uuid", "original_topic", "dlq_topic", "consumer_group", "handler",
		"reason", "error", "error_type", "stack", "attempts", "first_failure_at", "last_failure_at", "payload", "metadata",
		"message_uuid_raw", "metadata_raw", "fingerprint")
}

// MetadataMap returns the row's metadata byte for byte: MetadataRaw
// decoded, or for a row without it (an older version wrote it) the JSON
// of the metadata column.
func (r DeadLetterRow) MetadataMap() (map[string]string, error) {
	if r.MetadataRaw != nil {
		md, err := DecodeParkedMetadata(r.MetadataRaw)
		if err != nil {
			return nil, fmt.Errorf("dead letter %d: metadata_raw: %w", r.ID, err)
		}
		return md, nil
	}
	var md map[string]string
	if err := json.Unmarshal([]byte(r.Metadata), &md); err != nil {
		return nil, fmt.Errorf("dead letter %d: its stored metadata is not a JSON object of strings: %w", r.ID, err)
	}
	if md == nil {
		md = map[string]string{}
	}
	return md, nil
}

// where returns f's WHERE clause and its arguments.
func (f DeadLetterFilter) where() (string, []any) {
	var (
		conds []string
		args  []any
	)
	add := func(cond string, arg any) {
		args = append(args, arg)
		conds = append(conds, strings.ReplaceAll(cond, "?", "$"+strconv.Itoa(len(args))))
	}
	if len(f.IDs) > 0 {
		add("id = ANY(?)", f.IDs)
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
	if f.ErrorType != "" {
		add("error_type = ?", f.ErrorType)
	}
	if f.Pending {
		conds = append(conds, "state = 'dead'")
	}
	if f.Fingerprint != "" {
		hs, ts, es := make([]string, len(f.Unfingerprinted)), make([]string, len(f.Unfingerprinted)), make([]string, len(f.Unfingerprinted))
		for i, c := range f.Unfingerprinted {
			hs[i], ts[i], es[i] = c.Handler, c.ErrorType, c.Error
		}
		n := len(args)
		args = append(args, f.Fingerprint, hs, ts, es)
		conds = append(conds, fmt.Sprintf(`(fingerprint = $%d OR (fingerprint IS NULL AND (handler, error_type, error) IN
    (SELECT * FROM unnest($%d::text[], $%d::text[], $%d::text[]))))`, n+1, n+2, n+3, n+4))
	}
	if f.MaxID > 0 {
		add("id <= ?", f.MaxID)
	}
	if f.AfterID > 0 {
		add("id > ?", f.AfterID)
	}
	if len(conds) == 0 {
		return "", nil
	}
	return " WHERE " + strings.Join(conds, " AND "), args
}

// selectDeadLetters is the SELECT of cols of the rows f selects, by id.
func (f DeadLetterFilter) selectDeadLetters(cols, what string) Statement {
	where, args := f.where()
	q := "SELECT " + cols + " FROM millwright_dead_letters" + where + " ORDER BY id"
	if f.Limit > 0 {
		q += " LIMIT " + strconv.Itoa(f.Limit)
	}
	return Statement{SQL: q, Args: args, Expect: NoExpect, What: what}
}

func scanDeadLetterRow(r Row) (DeadLetterRow, error) {
	var (
		d        DeadLetterRow
		replayed sql.NullTime
		uuidRaw  []byte
		hasMDRaw bool
	)
	err := r.Scan(&d.ID, &d.MessageUUID, &d.OriginalTopic, &d.DLQTopic, &d.ConsumerGroup, &d.Handler,
		&d.Reason, &d.Error, &d.ErrorType, &d.Stack, &d.Attempts, &d.FirstFailure, &d.LastFailure, &d.Payload,
		&d.Metadata, &d.CreatedAt, &replayed, &d.ReplayCount, &d.State, &d.SupersededBy, &d.SupersededActor,
		&uuidRaw, &hasMDRaw, &d.MetadataRaw, &d.Fingerprint)
	d.MessageUUIDRaw = string(uuidRaw)
	if !hasMDRaw {
		d.MetadataRaw = nil
	} else if d.MetadataRaw == nil {
		d.MetadataRaw = []byte{}
	}
	if replayed.Valid {
		t := replayed.Time
		d.ReplayedAt = &t
	}
	return d, err
}

// ListDeadLetters returns the rows f selects, by id.
func ListDeadLetters(ctx context.Context, q Querier, f DeadLetterFilter) ([]DeadLetterRow, error) {
	var out []DeadLetterRow
	err := q.Query(ctx, f.selectDeadLetters(deadLetterColumns, "listing dead letters"), func(r Row) error {
		d, err := scanDeadLetterRow(r)
		out = append(out, d)
		return err
	})
	return out, err
}

// CountDeadLetters counts the rows f selects, ignoring f.Limit.
func CountDeadLetters(ctx context.Context, q Querier, f DeadLetterFilter) (int, error) {
	where, args := f.where()
	var n int
	err := q.QueryRow(ctx, Statement{SQL: "SELECT count(*) FROM millwright_dead_letters" + where, Args: args, Expect: NoExpect, What: "counting dead letters"}, &n)
	return n, err
}

// GetDeadLetter returns row id; no such row is an error for which IsNoRows
// holds.
func GetDeadLetter(ctx context.Context, q Querier, id int64) (DeadLetterRow, error) {
	return queryDeadLetterRow(ctx, q, Statement{SQL: "SELECT " + deadLetterColumns + " FROM millwright_dead_letters WHERE id = $1",
		Args: []any{id}, Expect: NoExpect, What: "reading a dead letter"})
}

func queryDeadLetterRow(ctx context.Context, q Querier, s Statement) (DeadLetterRow, error) {
	var (
		d     DeadLetterRow
		found bool
	)
	err := q.Query(ctx, s, func(r Row) error {
		if found {
			return nil
		}
		found = true
		var err error
		d, err = scanDeadLetterRow(r)
		return err
	})
	if err == nil && !found {
		err = sql.ErrNoRows
	}
	return d, err
}

// DeadLetterRef is what a replay reads of a row before locking it;
// MessageUUID is its bytes (message_uuid_raw).
type DeadLetterRef struct {
	ID                        int64
	MessageUUID, Topic, Error string
}

// ListDeadLetterRefs returns the references of the rows f selects, by id.
func ListDeadLetterRefs(ctx context.Context, q Querier, f DeadLetterFilter) ([]DeadLetterRef, error) {
	var out []DeadLetterRef
	err := q.Query(ctx, f.selectDeadLetters("id, "+uuidRawColumn+", original_topic, error", "listing dead letters to replay"), func(r Row) error {
		var (
			d    DeadLetterRef
			uuid []byte
		)
		err := r.Scan(&d.ID, &uuid, &d.Topic, &d.Error)
		d.MessageUUID = string(uuid)
		out = append(out, d)
		return err
	})
	return out, err
}

// LockDeadLetterForReplay reads row id and locks it in tx (FOR UPDATE SKIP
// LOCKED) unless it was replayed (and not force) or superseded by an
// edited copy (even with force). ok is false when the row is gone,
// replayed, superseded, or locked by a concurrent replay or edit.
func LockDeadLetterForReplay(ctx context.Context, tx Querier, id int64, force bool) (d DeadLetterRow, ok bool, err error) {
	d, err = queryDeadLetterRow(ctx, tx, Statement{SQL: lockDeadLetterSQL, Args: []any{id, force}, Expect: NoExpect, What: "locking a dead letter to replay"})
	if IsNoRows(err) {
		return d, false, nil
	}
	return d, err == nil, err
}

// LockDeadLetterToReplay is LockDeadLetterForReplay waiting for a row
// another transaction holds (FOR UPDATE, no SKIP LOCKED), then deciding on
// its committed state: of two replays (the CLI's, the console's) of one
// row, the second sees the first's outcome instead of skipping a row that
// may yet stay dead (dlq.ReplayTx).
func LockDeadLetterToReplay(ctx context.Context, tx Querier, id int64, force bool) (d DeadLetterRow, ok bool, err error) {
	d, err = queryDeadLetterRow(ctx, tx, Statement{SQL: lockDeadLetterWaitSQL, Args: []any{id, force}, Expect: NoExpect, What: "locking a dead letter to replay"})
	if IsNoRows(err) {
		return d, false, nil
	}
	return d, err == nil, err
}

// MarkDeadLetterReplayed records a replay of row id.
func MarkDeadLetterReplayed(ctx context.Context, q Querier, id int64) error {
	_, err := q.Exec(ctx, Statement{SQL: deadLetterReplayedSQL, Args: []any{id}, Expect: NoExpect, What: "marking a dead letter replayed"})
	return err
}

// DeadLetterReplayCount returns how many times row id was replayed. It
// reads FOR SHARE, so it waits for a transaction still holding the row
// (one whose commit's answer was lost) to end, and sees its outcome.
func DeadLetterReplayCount(ctx context.Context, q Querier, id int64) (int, error) {
	n, found := 0, false
	err := q.Query(ctx, Statement{SQL: `SELECT replay_count FROM millwright_dead_letters WHERE id = $1 FOR SHARE`,
		Args: []any{id}, Expect: NoExpect, What: "reading a dead letter's replay count"}, func(r Row) error {
		found = true
		return r.Scan(&n)
	})
	if err == nil && !found {
		err = sql.ErrNoRows
	}
	return n, err
}

// ResolveDeadLetter moves row id from dead to resolved (its message was
// applied later, through park), recording by. resolved is false when the
// row is not dead (replayed, superseded or resolved before) or gone.
func ResolveDeadLetter(ctx context.Context, q Querier, id int64, by string) (resolved bool, err error) {
	n, err := q.Exec(ctx, Statement{SQL: `UPDATE millwright_dead_letters SET state = 'resolved', resolved_at = now(), resolved_by = $2
WHERE id = $1 AND state = 'dead'`, Args: []any{id, by}, Expect: NoExpect, What: "resolving a dead letter"})
	return n == 1, err
}

// DeadLetterDepth counts the rows still dead, by original topic.
func DeadLetterDepth(ctx context.Context, q Querier) (map[string]int64, error) {
	out := map[string]int64{}
	err := q.Query(ctx, Statement{SQL: deadLetterDepthSQL, Expect: NoExpect, What: "measuring the dead-letter depth"}, func(r Row) error {
		var (
			topic string
			n     int64
		)
		err := r.Scan(&topic, &n)
		out[topic] = n
		return err
	})
	return out, err
}
