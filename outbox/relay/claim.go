package relay

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox/internal/eventmeta"
)

// laneShare is the first pass's rows per lane when the lanes get equal
// shares: the batch divided over the held lanes, rounded up.
func laneShare(batch, lanes int) int {
	if lanes < 1 {
		return batch
	}
	return (batch + lanes - 1) / lanes
}

// equalShares are the first pass's rows per lane (the claim's shares) when
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

// shares returns the first pass's rows per lane (the claim's shares) of a
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
// most BatchSize, spread over the lanes (storage.ClaimEvents), in id order
// within each lane.
func (r *Relay) claim(ctx context.Context, held []int32) ([]row, error) {
	shares := r.rates.shares(r.cfg.BatchSize, held)
	out, err := r.claimRows(ctx, held, shares)
	if err == nil {
		r.rates.learn(r.cfg.BatchSize, held, shares, out)
	}
	return out, err
}

// claimRows runs the claim with the shares given and reads its rows.
func (r *Relay) claimRows(ctx context.Context, held, shares []int32) ([]row, error) {
	var out []row
	var cache metaCache
	var claimed time.Time // after the statement's now()
	err := storage.ClaimEvents(ctx, r.db, held, r.cfg.BatchSize, shares, func(e storage.ClaimedEvent) error {
		if claimed.IsZero() {
			claimed = time.Now()
		}
		sr := storedRow{eventID: e.EventID, aggType: e.AggType, aggID: e.AggID, eventType: e.EvType,
			payload: e.Payload, raw: e.Raw, metadata: e.Metadata.String, createdAt: e.CreatedAt}
		rw := row{lane: e.Lane, id: e.ID, topic: e.Topic, retryCount: e.RetryCount, createdAt: e.CreatedAt,
			failing: e.Failing, claimed: claimed, aggType: e.AggType, aggID: e.AggID, aggKey: e.AggType + "\x00" + e.AggID}
		msg, err := rowMessageCached(sr, &cache)
		if err != nil {
			// Unreachable through Add; a hand-written row. Publish it with
			// the metadata its columns give rather than drop the event.
			r.cfg.Logger.Error("outbox relay: row metadata is not a string map; published with the metadata its columns give", err, watermill.LogFields{"id": rw.id, "topic": rw.topic, "message_uuid": sr.eventID})
		}
		msg.SetContext(ctx)
		rw.msg = msg
		out = append(out, rw)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("outbox relay: claiming rows%s: %w", storage.Hint(err), err)
	}
	return out, nil
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
// columns give (eventmeta.Derived), overridden by the metadata column. The
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
	eventmeta.Derived(r.eventID, r.aggType, r.aggID, r.eventType, r.payload.Valid, r.createdAt, msg.Metadata.Set)
	for k, v := range stored {
		msg.Metadata.Set(k, v)
	}
	msg.Metadata.Set(metadata.EventID, r.eventID)
	if r.aggID != "" && msg.Metadata.Get(metadata.OrderingKey) == "" {
		// An empty ordering key in the metadata column (set so by the
		// writer, or by hand) would send the aggregate unkeyed: it may
		// replace the aggregate's key, not remove it.
		msg.Metadata.Set(metadata.OrderingKey, eventmeta.OrderingKey(r.aggType, r.aggID))
	}
	return msg, err
}
