package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/metadata"
)

// laneExpr is a row's lane, exactly as millwright_outbox_pending_lane_idx
// indexes it (migrations/003_outbox_lanes.sql): a hash of the aggregate, or
// of the id for an event without one.
const laneExpr = `(CASE WHEN aggregate_id = '' THEN (id & 63)::int ELSE hashtext(aggregate_type || '/' || aggregate_id) & 63 END)`

// blockedCTE names the aggregates held back by a failing event: from the
// event on, nothing of the aggregate goes out until its backoff ends
// (the small index of failing rows answers it).
const blockedCTE = `blocked AS MATERIALIZED (
	SELECT aggregate_type, aggregate_id, min(id) AS head FROM millwright_outbox
	WHERE status = 'pending' AND retry_count > 0 AND next_attempt_at > now()
	GROUP BY aggregate_type, aggregate_id
)`

// claimLane selects, for lane l.lane, the due rows in id order that no
// failing event holds back: the columns cols, then tail (a LIMIT and/or
// OFFSET). Only the relay holding a lane reads it, so nothing is locked or
// leased: a row stays pending until it is marked, and an aggregate never
// overtakes its failing event, including events written after the failure.
func claimLane(cols, tail string) string {
	return `SELECT ` + cols + ` FROM millwright_outbox o
		WHERE ` + laneExpr + ` = l.lane AND status = 'pending' AND next_attempt_at <= now()
		  AND NOT EXISTS (SELECT 1 FROM blocked b WHERE b.aggregate_type = o.aggregate_type
			AND b.aggregate_id = o.aggregate_id AND b.head < o.id)
		ORDER BY id
		` + tail
}

// spreadLanes selects the columns cols of at most $2 due rows of the lanes
// in $1 (an int[]), spread over the lanes: first at most $3[i] rows of
// lane $1[i] (its share of the batch, an int[] of the same length), then,
// if the batch is not full, the lanes' next rows, lane after lane. Both
// passes read one snapshot with one now(), and the second skips exactly
// the rows the first took (same filter, same order, OFFSET the same
// share), so each lane's rows are the first of the lane in id order: no
// aggregate skips one of its rows, in this batch or the next. The fill
// keeps a batch full when few lanes have rows (one hot aggregate); the
// first pass keeps the rows of every busy lane in each batch, so the
// batch spans more aggregates (more partitions and ordering keys) than
// filling it from the first lanes would.
func spreadLanes(cols string) string {
	return `(SELECT c.* FROM unnest($1::int[], $3::int[]) AS l(lane, share)
	CROSS JOIN LATERAL (` + claimLane(cols, `LIMIT l.share`) + `) c)
UNION ALL
(SELECT c.* FROM unnest($1::int[], $3::int[]) AS l(lane, share)
	CROSS JOIN LATERAL (` + claimLane(cols, `OFFSET l.share LIMIT $2`) + `) c)
LIMIT $2`
}

// laneShare is the first pass's rows per lane when the lanes get equal
// shares: the batch divided over the held lanes, rounded up.
func laneShare(batch, lanes int) int {
	if lanes < 1 {
		return batch
	}
	return (batch + lanes - 1) / lanes
}

// equalShares are the first pass's rows per lane (spreadLanes' $3) when
// the lanes get equal shares.
func equalShares(batch int, held []int32) []int32 {
	shares := make([]int32, len(held))
	share := int32(laneShare(batch, len(held)))
	for i := range shares {
		shares[i] = share
	}
	return shares
}

// laneRates divides a relay's batches over its lanes in proportion to how
// densely each lane's due rows lie in the id sequence, so that the lanes
// advance through the backlog together: a lane holding one hot aggregate
// (a tenth of the events, eight times the rows of its neighbours per
// thousand ids) gets eight times their share of each batch, instead of
// the same share and a long tail after the other lanes ran dry, which
// only one relay, one batch at a time, can publish (its order forbids
// more). A lane's density is learnt from its rows in the relay's last
// batch of it: (n-1) / (last id - first id) of its n rows. A lane whose
// last batch left it dry gets a small share (a quarter of the equal one,
// at least 2), a lane not seen yet the mean. The shares only decide how
// many rows of each lane a batch takes first; each lane's rows are still
// its first due rows in id order. The mover (publishing in the database)
// shares and learns the same way. Safe for concurrent use (lane groups
// claim at once).
type laneRates struct {
	mu sync.Mutex
	// density of each lane's due rows in ids: > 0 learnt, 0 not known,
	// < 0 its last batch left it dry.
	density [laneCount]float64
}

// shares returns the first pass's rows per lane (spreadLanes' $3) of a
// batch of up to batch rows of the lanes held.
func (lr *laneRates) shares(batch int, held []int32) []int32 {
	lr.mu.Lock()
	defer lr.mu.Unlock()
	equal := laneShare(batch, len(held))
	var sum float64
	var known, unknown int
	for _, l := range held {
		switch d := lr.density[l]; {
		case d > 0:
			sum += d
			known++
		case d == 0:
			unknown++
		}
	}
	if known == 0 {
		return equalShares(batch, held)
	}
	// A dry lane still gets a few rows a batch, enough to learn its
	// density again once writers fill it, while the other lanes keep the
	// batches full; what it leaves unused goes to the fill pass.
	least := max(equal/4, 2)
	mean := sum / float64(known)
	total := sum + mean*float64(unknown)
	shares := make([]int32, len(held))
	for i, l := range held {
		w := lr.density[l]
		if w == 0 {
			w = mean
		}
		shares[i] = int32(max(least, int(math.Ceil(float64(batch)*max(w, 0)/total))))
	}
	return shares
}

// learn records the lanes' densities from a claim of up to batch rows
// over held, each lane's rows in id order.
func (lr *laneRates) learn(batch int, held, shares []int32, rows []row) {
	type span struct {
		n           int
		first, last int64
	}
	seen := make(map[int32]*span, len(held))
	for _, rw := range rows {
		s := seen[rw.lane]
		if s == nil {
			s = &span{first: rw.id}
			seen[rw.lane] = s
		}
		s.n++
		s.last = rw.id
	}
	// The first pass read every lane's share unless the batch filled up
	// within it (its LIMIT then cut the last lanes): a batch that is not
	// full, or that holds rows of the fill pass (a lane beyond its
	// share), had it all.
	whole := len(rows) < batch
	for i, l := range held {
		if s := seen[l]; s != nil && s.n > int(shares[i]) {
			whole = true
		}
	}
	lr.mu.Lock()
	defer lr.mu.Unlock()
	for i, l := range held {
		s := seen[l]
		switch {
		case whole && (s == nil || s.n < int(shares[i])):
			lr.density[l] = -1 // it gave less than its share: nothing more is due
		case s != nil && s.n > 1 && s.last > s.first:
			lr.density[l] = float64(s.n-1) / float64(s.last-s.first)
		}
	}
}

// claimedCTE names, as CTE claimed, the ids of at most $2 due rows of the
// lanes in $1 (an int[]), spread over the lanes by spreadLanes, each
// lane's in id order.
var claimedCTE = `WITH ` + blockedCTE + `, claimed AS (
	` + spreadLanes("id") + `
)`

// claimSQL is the claim of the publisher path, in one pass: the rows
// themselves, spread over the lanes by spreadLanes, each lane's in id
// order.
var claimSQL = `WITH ` + blockedCTE + `
` + spreadLanes(`l.lane, o.id, o.event_id, o.topic, o.aggregate_type, o.aggregate_id, o.event_type,
	o.payload::text, o.payload_raw, NULLIF(o.metadata, '{}')::text, o.retry_count,
	(extract(epoch FROM o.created_at) * 1000000)::int8,
	(extract(epoch FROM now() - o.first_failed_at) * 1000000)::int8`)

// row is one claimed outbox row.
type row struct {
	lane       int32
	id         int64
	topic      string
	aggType    string
	aggID      string
	aggKey     string
	retryCount int
	createdAt  time.Time
	// failing is how long ago the row's first failure was (the database's
	// clock, at the claim), counted from claimed: the retry budget's
	// elapsed time. Zero for a row that has not failed, or whose first
	// failure was not recorded (failing before migration 007).
	failing time.Duration
	claimed time.Time
	msg     *message.Message
}

// sinceFirstFailure is how long ago the row first failed, at now; 0 for a
// row that has not. It never counts more than has passed: claimed is taken
// after the claim's now().
func (rw row) sinceFirstFailure(now time.Time) time.Duration {
	if rw.retryCount == 0 || rw.failing == 0 {
		return 0
	}
	return rw.failing + max(now.Sub(rw.claimed), 0)
}

// claim is the first stage of a round: the due rows of the held lanes, at
// most BatchSize, spread over the lanes (spreadLanes), in id order within
// each lane.
func (r *Relay) claim(ctx context.Context, held []int32) ([]row, error) {
	stmt, err := r.claimStmt.get(ctx)
	if err != nil {
		return nil, err
	}
	shares := r.rates.shares(r.cfg.BatchSize, held)
	out, err := r.claimRows(ctx, stmt, held, shares)
	if err == nil {
		r.rates.learn(r.cfg.BatchSize, held, shares, out)
	}
	return out, err
}

// claimRows runs the claim with the shares given and reads its rows.
func (r *Relay) claimRows(ctx context.Context, stmt *sql.Stmt, held, shares []int32) ([]row, error) {
	rows, err := stmt.QueryContext(ctx, intArrayParam(held), r.cfg.BatchSize, intArrayParam(shares))
	if err != nil {
		return nil, fmt.Errorf("outbox relay: claiming rows: %w", err)
	}
	defer rows.Close()
	claimed := time.Now() // after the statement's now()
	var out []row
	var cache metaCache
	for rows.Next() {
		var (
			rw      row
			sr      storedRow
			meta    sql.NullString
			created int64 // µs since the epoch: cheaper to read than a timestamp
			failing sql.NullInt64
		)
		if err := rows.Scan(&rw.lane, &rw.id, &sr.eventID, &rw.topic, &sr.aggType, &sr.aggID, &sr.eventType, &sr.payload, &sr.raw, &meta, &rw.retryCount, &created, &failing); err != nil {
			return nil, fmt.Errorf("outbox relay: reading claimed row: %w", err)
		}
		sr.metadata, sr.createdAt = meta.String, time.UnixMicro(created)
		rw.createdAt = sr.createdAt
		rw.claimed = claimed
		if failing.Valid {
			rw.failing = max(time.Duration(failing.Int64)*time.Microsecond, time.Microsecond)
		}
		msg, err := rowMessageCached(sr, &cache)
		if err != nil {
			// Unreachable through Add; a hand-written row. Publish it with
			// the metadata its columns give rather than drop the event.
			r.cfg.Logger.Error("outbox relay: row metadata is not a string map; published with the metadata its columns give", err, watermill.LogFields{"id": rw.id, "topic": rw.topic, "message_uuid": sr.eventID})
		}
		msg.SetContext(ctx)
		rw.aggType, rw.aggID = sr.aggType, sr.aggID
		rw.aggKey = sr.aggType + "\x00" + sr.aggID
		rw.msg = msg
		out = append(out, rw)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("outbox relay: claiming rows: %w", err)
	}
	return out, nil
}

// intArrayParam renders lanes (or shares) as the text of an int[]
// parameter.
func intArrayParam(lanes []int32) string {
	b := make([]byte, 0, 4*len(lanes)+2)
	b = append(b, '{')
	for i, l := range lanes {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(l), 10)
	}
	return string(append(b, '}'))
}

// preparedStmt is a statement prepared once, on first use (database/sql
// prepares it again on each pooled connection): a prepared statement runs
// in one round trip and soon skips planning. close closes it on the
// pool's connections, where it would otherwise stay until the *sql.DB is
// closed; a later get prepares it again. It is safe for concurrent use.
type preparedStmt struct {
	db    *sql.DB
	query string
	what  string // "the claim", for errors

	mu   sync.Mutex
	stmt *sql.Stmt
}

func (p *preparedStmt) get(ctx context.Context) (*sql.Stmt, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stmt != nil {
		return p.stmt, nil
	}
	s, err := p.db.PrepareContext(ctx, p.query)
	if err != nil {
		return nil, fmt.Errorf("outbox relay: preparing %s%s: %w", p.what, migrateHint(err), err)
	}
	p.stmt = s
	return s, nil
}

func (p *preparedStmt) close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stmt == nil {
		return nil
	}
	err := p.stmt.Close()
	p.stmt = nil
	return err
}

// storedRow is an outbox row as read back for publishing.
type storedRow struct {
	eventID, aggType, aggID, eventType string
	payload                            sql.NullString
	raw                                []byte
	metadata                           string // JSON; "" for none
	createdAt                          time.Time
}

// rowMessage builds the message of a claimed row: the metadata the row's
// columns give (derivedMetadata), overridden by the metadata column. The
// event_id column is authoritative for the message UUID and
// metadata.EventID. A metadata column that is not a JSON object of strings
// (only a hand-written row can have one) is ignored and reported for the
// log; the event is still published.
func rowMessage(r storedRow) (*message.Message, error) {
	return rowMessageCached(r, nil)
}

// metaCache keeps the last metadata column parsed: the rows of a claim
// mostly carry the same one (their service's CloudEvents source), and a
// JSON parse per row showed in the relay's CPU profile.
type metaCache struct {
	text   string
	stored map[string]string // read only: rowMessageCached copies it
	err    error
}

func (c *metaCache) parse(text string) (map[string]string, error) {
	if text == "" {
		return nil, nil
	}
	if c != nil && c.text == text && (c.stored != nil || c.err != nil) {
		return c.stored, c.err
	}
	var stored map[string]string
	err := json.Unmarshal([]byte(text), &stored)
	if err != nil {
		stored = nil
	}
	if c != nil {
		c.text, c.stored, c.err = text, stored, err
	}
	return stored, err
}

// rowMessageCached is rowMessage with the metadata column parsed through
// cache (nil: no cache).
func rowMessageCached(r storedRow, cache *metaCache) (*message.Message, error) {
	body := r.raw
	if r.payload.Valid {
		body = []byte(r.payload.String)
	}
	msg := message.NewMessage(r.eventID, body)
	stored, err := cache.parse(r.metadata)
	msg.Metadata = make(message.Metadata, len(stored)+10)
	derivedMetadata(r.eventID, r.aggType, r.aggID, r.eventType, r.payload.Valid, r.createdAt, msg.Metadata.Set)
	for k, v := range stored {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(metadata.EventID, r.eventID)
	if r.aggID != "" && msg.Metadata.Get(metadata.OrderingKey) == "" {
		// An empty ordering key in the metadata column (set so by the
		// writer, or by hand) would send the aggregate unkeyed: it may
		// replace the aggregate's key, not remove it.
		msg.Metadata.Set(metadata.OrderingKey, orderingKey(r.aggType, r.aggID))
	}
	return msg, err
}
