package storage

import (
	"context"
	"database/sql"
	"encoding/binary"
	"errors"
	"fmt"
	"sort"
	"time"
)

// Parked keys: millwright_parked_keys (one row per handler and key whose
// messages wait for the retrier, the key's lock) and
// millwright_parked_messages (the messages, in their key's order).
//
// Order rests on the key row: parking behind a key and releasing it both
// lock the row, and the release decides "no message left" in a statement
// run after it holds the lock (so it sees every message parked before),
// never in the statement that takes the lock (whose snapshot may predate a
// message committed while it waited).

// ParkedMessage is one row of millwright_parked_messages.
type ParkedMessage struct {
	ID int64
	// Key is the message's lane (ParkLane); Key and MessageUUID are bytes
	// (a Go string holds any), stored as bytea.
	Handler, Key, MessageUUID string
	Topic                     string
	Payload                   []byte
	// Metadata is EncodeParkedMetadata's form of the message's metadata.
	Metadata []byte
	// DeadLetterID is the dead letter recorded for the message (0: none).
	DeadLetterID int64
	ParkedAt     time.Time
}

// Lane tags (park migration 002): a key's lane is its tag, then bytes.
const (
	laneKey     = 'k'
	laneKeyless = 'u'
)

// ParkLane returns the lane of a key: the key's bytes behind a tag, or,
// for a message without a key (keyless, key is then its UUID), another
// tag, so that no real key shares a keyless message's lane.
func ParkLane(key string, keyless bool) string {
	if keyless {
		return string(rune(laneKeyless)) + key
	}
	return string(rune(laneKey)) + key
}

// SplitParkLane is ParkLane's inverse. A lane without a known tag (a row
// written by hand) is returned whole as a key.
func SplitParkLane(lane string) (key string, keyless bool) {
	if lane == "" {
		return "", false
	}
	switch lane[0] {
	case laneKey:
		return lane[1:], false
	case laneKeyless:
		return lane[1:], true
	}
	return lane, false
}

// EncodeParkedMetadata encodes md byte for byte, entries by key: for
// each, the key's length (4 bytes, big endian), the key, the value's
// length, the value. Park migration 002 writes the same form, and so do
// dead letters (DeadLetterRow.MetadataRaw, dlq migration 005).
func EncodeParkedMetadata(md map[string]string) []byte {
	keys := make([]string, 0, len(md))
	n := 0
	for k, v := range md {
		keys = append(keys, k)
		n += 8 + len(k) + len(v)
	}
	sort.Strings(keys)
	out := make([]byte, 0, n)
	for _, k := range keys {
		out = binary.BigEndian.AppendUint32(out, uint32(len(k)))
		out = append(out, k...)
		out = binary.BigEndian.AppendUint32(out, uint32(len(md[k])))
		out = append(out, md[k]...)
	}
	return out
}

// ErrParkedMetadata is returned (wrapped) by DecodeParkedMetadata for
// bytes EncodeParkedMetadata did not write.
var ErrParkedMetadata = errors.New("parked metadata is not in its stored form")

// DecodeParkedMetadata is EncodeParkedMetadata's inverse.
func DecodeParkedMetadata(b []byte) (map[string]string, error) {
	md := map[string]string{}
	next := func(what string) (string, error) {
		if len(b) < 4 {
			return "", fmt.Errorf("%w: %d bytes left where the length of a %s starts", ErrParkedMetadata, len(b), what)
		}
		n := binary.BigEndian.Uint32(b)
		if uint64(len(b)-4) < uint64(n) {
			return "", fmt.Errorf("%w: a %s of %d bytes, %d left", ErrParkedMetadata, what, n, len(b)-4)
		}
		v := string(b[4 : 4+n])
		b = b[4+n:]
		return v, nil
	}
	for len(b) > 0 {
		k, err := next("key")
		if err != nil {
			return nil, err
		}
		v, err := next("value")
		if err != nil {
			return nil, err
		}
		md[k] = v
	}
	return md, nil
}

// ParkFailure is the failure state of a key's head message.
type ParkFailure struct {
	// DueIn is how long from now the head is retried.
	DueIn time.Duration
	// Attempts made so far (in place included), the retrier's rounds,
	// and the last jittered delay.
	Attempts, Rounds int
	PrevDelay        time.Duration
	// FirstFailure and LastFailure of the head; a zero FirstFailure keeps
	// the stored one.
	FirstFailure, LastFailure time.Time
	LastError                 string
}

// ParkedClaim is a due key claimed by a retrier, with its head message
// (nil when the key has none left: release it).
type ParkedClaim struct {
	Handler, Key              string
	Claim                     int64
	Attempts, Rounds          int
	PrevDelay                 time.Duration
	FirstFailure, LastFailure sql.NullTime
	Head                      *ParkedMessage
}

// ParkedKey is a parked key as the operator lists it.
type ParkedKey struct {
	Handler, Key              string
	Messages                  int64
	DueAt                     time.Time
	Held                      bool
	Attempts, Rounds          int
	FirstFailure, LastFailure sql.NullTime
	LastError                 string
	DeadLetterID              sql.NullInt64
	CreatedAt                 time.Time
}

// ParkedDepth is one handler's parked keys and messages (Held counts held
// keys).
type ParkedDepth struct {
	Keys, Messages, Held int64
}

func ms(d time.Duration) int64 { return d.Milliseconds() }

func bytesOrEmpty(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

const parkBehindSQL = `WITH k AS (SELECT handler, key FROM millwright_parked_keys WHERE handler = $1 AND key = $2 FOR UPDATE),
ins AS (INSERT INTO millwright_parked_messages (handler, key, message_uuid, topic, payload, metadata)
    SELECT k.handler, k.key, $3, $4, $5, $6 FROM k
    ON CONFLICT (handler, message_uuid) DO NOTHING RETURNING id)
SELECT EXISTS (SELECT 1 FROM k), EXISTS (SELECT 1 FROM ins)`

// ParkBehind parks m behind its key when the key is parked, in one
// statement that locks the key's row: parked is false (nothing written)
// when the key is not parked, so every earlier message of the key is done.
// A message already parked (same handler and UUID) counts as parked.
func ParkBehind(ctx context.Context, q Querier, m ParkedMessage) (parked bool, err error) {
	var inserted bool
	err = q.QueryRow(ctx, Statement{SQL: parkBehindSQL, Args: []any{
		m.Handler, []byte(m.Key), []byte(m.MessageUUID), m.Topic, bytesOrEmpty(m.Payload), bytesOrEmpty(m.Metadata),
	}, Expect: NoExpect, What: "parking a message behind its key"}, &parked, &inserted)
	return parked, err
}

const parkHeadSQL = `WITH k AS (INSERT INTO millwright_parked_keys (handler, key, due_at, attempts, prev_delay_ms, first_failure_at, last_failure_at, last_error,
        rounds, held, dead_letter_id)
    VALUES ($1, $2, now() + $7::bigint * interval '1 millisecond', $8, $9, $10, $11, $12, $13, $14, NULLIF($15::bigint, 0))
    ON CONFLICT (handler, key) DO UPDATE SET handler = EXCLUDED.handler
    RETURNING handler, key, (xmax = 0) AS fresh),
ins AS (INSERT INTO millwright_parked_messages (handler, key, message_uuid, topic, payload, metadata, dead_letter_id)
    SELECT k.handler, k.key, $3, $4, $5, $6, NULLIF($15::bigint, 0) FROM k
    ON CONFLICT (handler, message_uuid) DO NOTHING RETURNING id)
SELECT fresh FROM k`

// ParkHead parks m, which failed, as its key's head with failure state f,
// in one statement. When the key was parked meanwhile (another consumer of
// the key) m goes behind its messages instead, and head is false.
func ParkHead(ctx context.Context, q Querier, m ParkedMessage, f ParkFailure) (head bool, err error) {
	return parkHead(ctx, q, m, f, false, 0)
}

func parkHead(ctx context.Context, q Querier, m ParkedMessage, f ParkFailure, held bool, deadLetter int64) (head bool, err error) {
	err = q.QueryRow(ctx, Statement{SQL: parkHeadSQL, Args: []any{
		m.Handler, []byte(m.Key), []byte(m.MessageUUID), m.Topic, bytesOrEmpty(m.Payload), bytesOrEmpty(m.Metadata),
		ms(f.DueIn), f.Attempts, ms(f.PrevDelay), f.FirstFailure, f.LastFailure, f.LastError,
		f.Rounds, held, deadLetter,
	}, Expect: NoExpect, What: "parking a failed message"}, &head)
	return head, err
}

// RecordDeadLetter writes a dead letter in tx and returns its id (0 when
// it was recorded before): package dlq's writer (dlq.RecordTx), so that
// park's dead letters are written like every other. ParkDead and
// DeadLetterParked take one; nil writes dl with InsertDeadLetter.
type RecordDeadLetter func(ctx context.Context, tx Tx) (int64, error)

func (rec RecordDeadLetter) write(ctx context.Context, tx Tx, dl DeadLetterRow) (int64, error) {
	if rec == nil {
		return InsertDeadLetter(ctx, tx, dl)
	}
	return rec(ctx, tx)
}

// ParkDead records dl, the dead letter of m whose handler failed
// permanently before its key was parked (through rec), and with hold also
// parks m as its key's held head (in one transaction), so that the key's
// later messages wait for the operator. It returns the dead letter's id.
func ParkDead(ctx context.Context, p Pool, m ParkedMessage, dl DeadLetterRow, hold bool, rec RecordDeadLetter) (id int64, err error) {
	tx, err := p.Begin(ctx, TxOptions{})
	if err != nil {
		return 0, err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if id, err = rec.write(ctx, tx, dl); err != nil {
		return 0, err
	}
	if !hold {
		return id, tx.Commit(ctx)
	}
	f := ParkFailure{Attempts: dl.Attempts, FirstFailure: dl.FirstFailure, LastFailure: dl.LastFailure, LastError: dl.Error}
	if _, err = parkHead(ctx, tx, m, f, true, id); err != nil {
		return 0, err
	}
	return id, tx.Commit(ctx)
}

const claimParkedSQL = `WITH c AS (SELECT handler, key FROM millwright_parked_keys
    WHERE NOT held AND due_at <= now() AND handler = ANY($1)
    ORDER BY due_at LIMIT $2 FOR UPDATE SKIP LOCKED),
u AS (UPDATE millwright_parked_keys k SET due_at = now() + $3::bigint * interval '1 millisecond', claims = k.claims + 1,
        running_claim = k.claims + 1
    FROM c WHERE k.handler = c.handler AND k.key = c.key
    RETURNING k.handler, k.key, k.claims, k.attempts, k.rounds, k.prev_delay_ms, k.first_failure_at, k.last_failure_at)
SELECT u.handler, u.key, u.claims, u.attempts, u.rounds, u.prev_delay_ms, u.first_failure_at, u.last_failure_at,
    m.id, m.message_uuid, m.topic, m.payload, m.metadata, m.parked_at, m.dead_letter_id
FROM u LEFT JOIN LATERAL (SELECT * FROM millwright_parked_messages p
    WHERE p.handler = u.handler AND p.key = u.key ORDER BY p.id LIMIT 1) m ON true`

// ClaimParked claims up to limit due keys of handlers that no other
// retrier holds (SKIP LOCKED), moving their due time lease ahead so that
// a retrier that dies leaves them due again then. It marks the round as
// running (running_claim, the claim's number) until the round ends
// (RescheduleParked, CompleteParked, DeadLetterParked, HoldParked, or
// ReleaseParked by an operator), so that ReplaceParked leaves a running
// head alone while its lease holds.
func ClaimParked(ctx context.Context, q Querier, handlers []string, limit int, lease time.Duration) ([]ParkedClaim, error) {
	var out []ParkedClaim
	err := q.Query(ctx, Statement{SQL: claimParkedSQL, Args: []any{handlers, limit, ms(lease)}, Expect: NoExpect, What: "claiming due parked keys"},
		func(r Row) error {
			var (
				c               ParkedClaim
				prev            int64
				id, dl          sql.NullInt64
				key, uuid, meta []byte
				topic           sql.NullString
				payload         []byte
				at              sql.NullTime
			)
			if err := r.Scan(&c.Handler, &key, &c.Claim, &c.Attempts, &c.Rounds, &prev, &c.FirstFailure, &c.LastFailure,
				&id, &uuid, &topic, &payload, &meta, &at, &dl); err != nil {
				return err
			}
			c.Key = string(key)
			c.PrevDelay = time.Duration(prev) * time.Millisecond
			if id.Valid {
				c.Head = &ParkedMessage{ID: id.Int64, Handler: c.Handler, Key: c.Key, MessageUUID: string(uuid),
					Topic: topic.String, Payload: payload, Metadata: meta, ParkedAt: at.Time, DeadLetterID: dl.Int64}
			}
			out = append(out, c)
			return nil
		})
	return out, err
}

// ErrParkedClaimLost is returned (wrapped) when a claim is no longer the
// key's latest (its lease passed and another retrier claimed the key), or
// the key is gone or not in the state the operation needs.
var ErrParkedClaimLost = errors.New("parked key claim lost")

// lockParked is the first statement of a transaction on a key: it locks
// the key's row, and fails unless the row is there with claim number claim
// (any when claim < 0) and, when heldOnly, held.
func lockParked(handler, key string, claim int64, heldOnly bool) Statement {
	return Statement{SQL: `UPDATE millwright_parked_keys SET claims = claims WHERE handler = $1 AND key = $2 AND ($3 < 0 OR claims = $3) AND (held OR NOT $4)`,
		Args: []any{handler, []byte(key), claim, heldOnly}, Expect: 1, What: "locking parked key " + laneText(key)}
}

// advanceParked, run while the key's row is locked and after its head was
// deleted, makes the key's next message due at once (no round running on
// it), or releases the key when none is left. Its snapshot is taken after the lock, so it sees
// every message parked behind the key.
func advanceParked(handler, key string) Statement {
	return S(`WITH more AS (SELECT EXISTS (SELECT 1 FROM millwright_parked_messages WHERE handler = $1 AND key = $2) AS m),
u AS (UPDATE millwright_parked_keys SET due_at = now(), held = false, attempts = 0, rounds = 0, prev_delay_ms = 0,
        first_failure_at = NULL, last_failure_at = NULL, last_error = '', dead_letter_id = NULL, running_claim = NULL
    WHERE handler = $1 AND key = $2 AND (SELECT m FROM more) RETURNING 1)
DELETE FROM millwright_parked_keys WHERE handler = $1 AND key = $2 AND NOT (SELECT m FROM more)`, handler, []byte(key))
}

// laneText is a lane as an error message shows it: the key quoted as Go
// does (a binary key's bytes escaped), or the keyless message's UUID.
func laneText(lane string) string {
	key, keyless := SplitParkLane(lane)
	if keyless {
		return fmt.Sprintf("(no key: message %q)", key)
	}
	return fmt.Sprintf("%q", key)
}

// inKeyTx runs fn in a transaction whose first statement is lock; a lock
// that finds no row is ErrParkedClaimLost.
func inKeyTx(ctx context.Context, p Pool, lock Statement, fn func(Tx) error) error {
	tx, err := p.Begin(ctx, TxOptions{First: []Statement{lock}})
	if errors.Is(err, ErrConflict) {
		return fmt.Errorf("%s: %w", lock.What, ErrParkedClaimLost)
	}
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// CompleteParked deletes the head message headID of a key claimed with
// claim (it succeeded) and makes the key's next message due at once, or
// releases the key. When the head had a dead letter, resolved (unless
// nil) is called with its id in the same transaction: the dead letter was
// applied after all. ErrParkedClaimLost when the claim is no longer the
// key's.
func CompleteParked(ctx context.Context, p Pool, handler, key string, claim, headID int64, resolved func(ctx context.Context, tx Tx, deadLetterID int64) error) error {
	return inKeyTx(ctx, p, lockParked(handler, key, claim, false), func(tx Tx) error {
		var dl int64
		err := tx.QueryRow(ctx, Statement{SQL: `DELETE FROM millwright_parked_messages WHERE handler = $1 AND key = $2 AND id = $3
RETURNING COALESCE(dead_letter_id, 0)`, Args: []any{handler, []byte(key), headID}, Expect: NoExpect, What: "deleting the applied head of parked key " + laneText(key)}, &dl)
		if err != nil && !IsNoRows(err) {
			return err
		}
		if _, err := tx.Exec(ctx, advanceParked(handler, key)); err != nil {
			return err
		}
		if dl != 0 && resolved != nil {
			return resolved(ctx, tx, dl)
		}
		return nil
	})
}

// ExtendParked moves the due time of a key claimed with claim to lease
// from now: its round is still running. ErrParkedClaimLost when the claim
// is no longer the key's.
func ExtendParked(ctx context.Context, q Querier, handler, key string, claim int64, lease time.Duration) error {
	_, err := q.Exec(ctx, Statement{SQL: `UPDATE millwright_parked_keys SET due_at = now() + $4::bigint * interval '1 millisecond'
WHERE handler = $1 AND key = $2 AND claims = $3 AND NOT held`, Args: []any{handler, []byte(key), claim, ms(lease)}, Expect: 1,
		What: "extending the claim of parked key " + laneText(key)})
	if errors.Is(err, ErrConflict) {
		return fmt.Errorf("extending the claim of parked key %s: %w", laneText(key), ErrParkedClaimLost)
	}
	return err
}

// HoldParked holds a key claimed with claim, its head kept, recording
// cause as its last error: a record the retrier could not handle (it
// panicked, or the row does not decode), set aside for an operator.
// ErrParkedClaimLost when the claim is no longer the key's.
func HoldParked(ctx context.Context, q Querier, handler, key string, claim int64, cause string) error {
	_, err := q.Exec(ctx, Statement{SQL: `UPDATE millwright_parked_keys SET held = true, last_error = $4, last_failure_at = now(),
    first_failure_at = COALESCE(first_failure_at, now()), running_claim = NULL
WHERE handler = $1 AND key = $2 AND claims = $3`, Args: []any{handler, []byte(key), claim, cause}, Expect: 1,
		What: "holding parked key " + laneText(key)})
	if errors.Is(err, ErrConflict) {
		return fmt.Errorf("holding parked key %s: %w", laneText(key), ErrParkedClaimLost)
	}
	return err
}

// ReplacedParked says what ReplaceParked did.
type ReplacedParked struct {
	// Replaced is true when a parked message took the replay's payload
	// and metadata; Key is its lane.
	Replaced bool
	Key      string
	// Released is true when it was its key's held head: the key is no
	// longer held and its head is due at once, with a fresh budget.
	Released bool
}

// ErrParkedHeadRunning is returned (wrapped) by ReplaceParked when the
// replay's parked message is its key's head and a retrier's round is
// running it now (its lease holds): replacing it then would be lost if
// the round applied the old message. Nothing is written; try again after
// the round.
var ErrParkedHeadRunning = errors.New("its head is being retried now; the replay is redelivered after the round")

const findReplacedSQL = `SELECT id, key FROM millwright_parked_messages
WHERE handler = $1 AND (dead_letter_id = $2 OR message_uuid = $3)
ORDER BY (dead_letter_id IS NOT DISTINCT FROM $2) DESC, id LIMIT 1`

// ReplaceParked gives the replay of dead letter deadLetterID (a message
// with UUID m.MessageUUID) its parked message's place: the parked message
// of that dead letter (else of that UUID) of handler takes m's payload and
// metadata (merge, when not nil, returns the metadata to store from the
// parked one's). When it is its key's held head, the key is released from
// the hold, its head due at once with a fresh budget. Nothing is written
// when no such message is parked. It runs in one transaction that locks
// the key's row first, like every change of a key.
//
// When the message is its key's head and a retrier's round is running it
// (claimed, its lease not passed), nothing is written and the error is
// ErrParkedHeadRunning: the caller redelivers the replay later. After the
// round the head is either still parked (the round failed: the replay
// replaces it then) or gone (the round applied it, and its dead letter
// was resolved: the replay then matches nothing and goes through like any
// message). A lease that passed (the retrier died) does not block.
func ReplaceParked(ctx context.Context, p Pool, handler string, deadLetterID int64, m ParkedMessage, merge func(parked []byte) []byte) (ReplacedParked, error) {
	var (
		out  ReplacedParked
		id   int64
		lane []byte
	)
	err := p.QueryRow(ctx, Statement{SQL: findReplacedSQL, Args: []any{handler, deadLetterID, []byte(m.MessageUUID)},
		Expect: NoExpect, What: "finding the parked message of a replay"}, &id, &lane)
	if IsNoRows(err) {
		return out, nil
	}
	if err != nil {
		return out, err
	}
	key := string(lane)
	err = inKeyTx(ctx, p, lockParked(handler, key, -1, false), func(tx Tx) error {
		var (
			parked              []byte
			held, head, running bool
		)
		err := tx.QueryRow(ctx, Statement{SQL: `SELECT m.metadata, k.held,
    m.id = (SELECT min(h.id) FROM millwright_parked_messages h WHERE h.handler = m.handler AND h.key = m.key),
    k.running_claim IS NOT NULL AND k.running_claim = k.claims AND NOT k.held AND k.due_at > now()
FROM millwright_parked_messages m JOIN millwright_parked_keys k ON k.handler = m.handler AND k.key = m.key
WHERE m.id = $1 AND m.handler = $2 AND m.key = $3 FOR UPDATE OF m`, Args: []any{id, handler, lane}, Expect: NoExpect,
			What: "locking the parked message of a replay"}, &parked, &held, &head, &running)
		if IsNoRows(err) {
			return nil // applied or dropped meanwhile
		}
		if err != nil {
			return err
		}
		if head && running {
			return fmt.Errorf("parked key %s: %w", laneText(key), ErrParkedHeadRunning)
		}
		md := m.Metadata
		if merge != nil {
			md = merge(parked)
		}
		if _, err := tx.Exec(ctx, S(`UPDATE millwright_parked_messages SET payload = $2, metadata = $3 WHERE id = $1`,
			id, bytesOrEmpty(m.Payload), bytesOrEmpty(md))); err != nil {
			return err
		}
		out.Replaced, out.Key = true, key
		if held && head {
			if _, err := tx.Exec(ctx, Statement{SQL: `UPDATE millwright_parked_keys SET held = false, due_at = now(), attempts = 0, rounds = 0,
    prev_delay_ms = 0, first_failure_at = NULL, last_failure_at = NULL, last_error = '', dead_letter_id = NULL
WHERE handler = $1 AND key = $2`, Args: []any{handler, lane}, Expect: 1, What: "lifting the hold of parked key " + laneText(key)}); err != nil {
				return err
			}
			out.Released = true
		}
		return nil
	})
	if errors.Is(err, ErrParkedClaimLost) {
		return ReplacedParked{}, nil // the key was released meanwhile
	}
	if err != nil {
		return ReplacedParked{}, err
	}
	return out, nil
}

// RescheduleParked records the failure f of a claimed key's head and makes
// it due f.DueIn from now; its round is over. ErrParkedClaimLost when the claim is no longer
// the key's.
func RescheduleParked(ctx context.Context, q Querier, handler, key string, claim int64, f ParkFailure) error {
	_, err := q.Exec(ctx, Statement{SQL: `UPDATE millwright_parked_keys SET due_at = now() + $4::bigint * interval '1 millisecond',
    attempts = $5, prev_delay_ms = $6, first_failure_at = COALESCE(first_failure_at, $7), last_failure_at = $8, last_error = $9, rounds = $10,
    running_claim = NULL
WHERE handler = $1 AND key = $2 AND claims = $3`, Args: []any{handler, []byte(key), claim, ms(f.DueIn), f.Attempts, ms(f.PrevDelay),
		f.FirstFailure, f.LastFailure, f.LastError, f.Rounds}, Expect: 1, What: "rescheduling parked key " + laneText(key)})
	if errors.Is(err, ErrConflict) {
		return fmt.Errorf("rescheduling parked key %s: %w", laneText(key), ErrParkedClaimLost)
	}
	return err
}

// DeadLetterParked records dl, the dead letter of a claimed key's head
// headID, in millwright_dead_letters (through rec), in one transaction with what follows
// for the key: hold keeps the head and holds the key (nothing of it runs
// until ReleaseParked or RetryParked), else the head is deleted and the
// next message is due at once. It returns the dead letter's id (0 when the
// same dead letter was stored before).
func DeadLetterParked(ctx context.Context, p Pool, claim, headID int64, rounds int, dl DeadLetterRow, key string, hold bool, rec RecordDeadLetter) (id int64, err error) {
	err = inKeyTx(ctx, p, lockParked(dl.Handler, key, claim, false), func(tx Tx) error {
		var err error
		if id, err = rec.write(ctx, tx, dl); err != nil {
			return err
		}
		if hold {
			return tx.Batch(ctx, Statement{SQL: `UPDATE millwright_parked_keys SET held = true, dead_letter_id = NULLIF($3, 0),
    attempts = $4, last_failure_at = $5, last_error = $6, first_failure_at = COALESCE(first_failure_at, $7), rounds = $8,
    running_claim = NULL
WHERE handler = $1 AND key = $2`, Args: []any{dl.Handler, []byte(key), id, dl.Attempts, dl.LastFailure, dl.Error, dl.FirstFailure, rounds},
				Expect: 1, What: "holding parked key " + laneText(key)},
				S(`UPDATE millwright_parked_messages SET dead_letter_id = NULLIF($2::bigint, 0) WHERE id = $1`, headID, id))
		}
		return tx.Batch(ctx, S(`DELETE FROM millwright_parked_messages WHERE handler = $1 AND key = $2 AND id = $3`, dl.Handler, []byte(key), headID),
			advanceParked(dl.Handler, key))
	})
	return id, err
}

// ReleaseParked drops a held key's head (its dead letter stays in
// millwright_dead_letters) and makes the next message due at once, or
// releases the key. force drops the head of a key that is not held too.
// ErrParkedClaimLost when the key is not parked (or not held, without
// force).
func ReleaseParked(ctx context.Context, p Pool, handler, key string, force bool) error {
	return inKeyTx(ctx, p, lockParked(handler, key, -1, !force), func(tx Tx) error {
		return tx.Batch(ctx, S(`DELETE FROM millwright_parked_messages WHERE id = (SELECT min(id) FROM millwright_parked_messages
    WHERE handler = $1 AND key = $2)`, handler, []byte(key)), advanceParked(handler, key))
	})
}

// DropParkedHead is ReleaseParked in the caller's transaction q: it locks
// the key (held only, unless force), deletes its head and makes the next
// message due at once, or releases the key. before, if not nil, runs after
// the lock with the head about to go (package park's skip dead-letters it
// there). ErrParkedClaimLost when the key is not parked (or not held).
func DropParkedHead(ctx context.Context, q Querier, handler, key string, force bool, before func(head ParkedMessage) error) error {
	lock := lockParked(handler, key, -1, !force)
	if _, err := q.Exec(ctx, lock); errors.Is(err, ErrConflict) {
		return fmt.Errorf("%s: %w", lock.What, ErrParkedClaimLost)
	} else if err != nil {
		return err
	}
	if before != nil {
		msgs, err := ListParkedMessages(ctx, q, handler, key)
		if err != nil {
			return err
		}
		if len(msgs) == 0 {
			return fmt.Errorf("parked key %s has no message: %w", laneText(key), ErrParkedClaimLost)
		}
		if err := before(msgs[0]); err != nil {
			return err
		}
	}
	if _, err := q.Exec(ctx, S(`DELETE FROM millwright_parked_messages WHERE id = (SELECT min(id) FROM millwright_parked_messages
    WHERE handler = $1 AND key = $2)`, handler, []byte(key))); err != nil {
		return err
	}
	_, err := q.Exec(ctx, advanceParked(handler, key))
	return err
}

// RetryParked makes a parked key's head due at once with a fresh budget,
// held or not. A key whose round is running now keeps its lease (the
// round's outcome decides what comes next): made due, another retrier
// would run the head beside it, and a replay would replace it under it. ErrParkedClaimLost when the key is not parked.
func RetryParked(ctx context.Context, q Querier, handler, key string) error {
	_, err := q.Exec(ctx, Statement{SQL: `UPDATE millwright_parked_keys SET held = false,
    due_at = CASE WHEN running_claim = claims AND NOT held AND due_at > now() THEN due_at ELSE now() END,
    attempts = 0, rounds = 0, prev_delay_ms = 0,
    first_failure_at = NULL, last_failure_at = NULL, dead_letter_id = NULL WHERE handler = $1 AND key = $2`,
		Args: []any{handler, []byte(key)}, Expect: 1, What: "retrying parked key " + laneText(key)})
	if errors.Is(err, ErrConflict) {
		return fmt.Errorf("retrying parked key %s: %w", laneText(key), ErrParkedClaimLost)
	}
	return err
}

// ListParked returns the parked keys of handler (all handlers when ""),
// only lane key when key is not "", held ones first then by due time, at
// most limit (0: all).
func ListParked(ctx context.Context, q Querier, handler, key string, limit int) ([]ParkedKey, error) {
	s := `SELECT k.handler, k.key, (SELECT count(*) FROM millwright_parked_messages m WHERE m.handler = k.handler AND m.key = k.key),
    k.due_at, k.held, k.attempts, k.rounds, k.first_failure_at, k.last_failure_at, k.last_error, k.dead_letter_id, k.created_at
FROM millwright_parked_keys k WHERE ($1 = '' OR k.handler = $1) AND (octet_length($2::bytea) = 0 OR k.key = $2::bytea)
ORDER BY k.held DESC, k.due_at, k.handler, k.key`
	args := []any{handler, []byte(key)}
	if limit > 0 {
		s += ` LIMIT $3`
		args = append(args, limit)
	}
	var out []ParkedKey
	err := q.Query(ctx, Statement{SQL: s, Args: args, Expect: NoExpect, What: "listing parked keys"}, func(r Row) error {
		var (
			k    ParkedKey
			lane []byte
		)
		if err := r.Scan(&k.Handler, &lane, &k.Messages, &k.DueAt, &k.Held, &k.Attempts, &k.Rounds, &k.FirstFailure, &k.LastFailure,
			&k.LastError, &k.DeadLetterID, &k.CreatedAt); err != nil {
			return err
		}
		k.Key = string(lane)
		out = append(out, k)
		return nil
	})
	return out, err
}

// ListParkedMessages returns the parked messages of one key, in order.
func ListParkedMessages(ctx context.Context, q Querier, handler, key string) ([]ParkedMessage, error) {
	var out []ParkedMessage
	err := q.Query(ctx, S(`SELECT id, handler, key, message_uuid, topic, payload, metadata, parked_at, COALESCE(dead_letter_id, 0)
FROM millwright_parked_messages WHERE handler = $1 AND key = $2 ORDER BY id`, handler, []byte(key)), func(r Row) error {
		var (
			m         ParkedMessage
			lane, uid []byte
		)
		if err := r.Scan(&m.ID, &m.Handler, &lane, &uid, &m.Topic, &m.Payload, &m.Metadata, &m.ParkedAt, &m.DeadLetterID); err != nil {
			return err
		}
		m.Key, m.MessageUUID = string(lane), string(uid)
		out = append(out, m)
		return nil
	})
	return out, err
}

// ParkedDepths returns the parked keys and messages by handler.
func ParkedDepths(ctx context.Context, q Querier) (map[string]ParkedDepth, error) {
	out := map[string]ParkedDepth{}
	err := q.Query(ctx, S(`SELECT k.handler, count(*), count(*) FILTER (WHERE k.held),
    COALESCE(sum((SELECT count(*) FROM millwright_parked_messages m WHERE m.handler = k.handler AND m.key = k.key)), 0)::bigint
FROM millwright_parked_keys k GROUP BY k.handler`), func(r Row) error {
		var (
			h string
			d ParkedDepth
		)
		if err := r.Scan(&h, &d.Keys, &d.Held, &d.Messages); err != nil {
			return err
		}
		out[h] = d
		return nil
	})
	return out, err
}
