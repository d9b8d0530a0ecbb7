package storage

import (
	"context"
	"database/sql"
	"encoding/hex"
)

// What the operator's tools (the console's parked keys page, a dead
// letter's page) read of park's tables, beside ListParked.

// ParkTablesExist reports whether the search_path reaches
// millwright_parked_keys: a schema where only the dlq was migrated has no
// parked keys to show, which is not an error on a dead letter's page.
func ParkTablesExist(ctx context.Context, q Querier) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, S(`SELECT to_regclass('millwright_parked_keys') IS NOT NULL
    AND to_regclass('millwright_parked_messages') IS NOT NULL`), &ok)
	return ok, err
}

// ParkedLaneOfDeadLetter returns the lane of handler's parked key whose
// head (or a parked message) carries dead letter id, found false when
// none does.
func ParkedLaneOfDeadLetter(ctx context.Context, q Querier, handler string, id int64) (lane string, found bool, err error) {
	var b []byte
	err = q.QueryRow(ctx, S(`SELECT key FROM (
    SELECT key FROM millwright_parked_keys WHERE handler = $1 AND dead_letter_id = $2
    UNION ALL
    SELECT key FROM millwright_parked_messages WHERE handler = $1 AND dead_letter_id = $2) l LIMIT 1`, handler, id), &b)
	if IsNoRows(err) {
		return "", false, nil
	}
	return string(b), err == nil, err
}

// ParkedHead is the head message of a parked key, without its payload.
type ParkedHead struct {
	Handler, Key, MessageUUID, Topic string
	ID, DeadLetterID                 int64
	Bytes                            int
	ParkedAt                         sql.NullTime
}

// ParkedHeads returns the head messages of the given keys (handlers[i],
// lanes[i]), one index probe per key; a key with no message left has
// none.
func ParkedHeads(ctx context.Context, q Querier, handlers, lanes []string) ([]ParkedHead, error) {
	// The lanes go as hex text: a text[] is sent the same way by every
	// driver and renderer, a bytea[] is not.
	hx := make([]string, len(lanes))
	for i, l := range lanes {
		hx[i] = hex.EncodeToString([]byte(l))
	}
	var out []ParkedHead
	err := q.Query(ctx, S(`SELECT k.h, k.k, m.id, m.message_uuid, m.topic, COALESCE(m.dead_letter_id, 0), octet_length(m.payload), m.parked_at
FROM (SELECT h, decode(kx, 'hex') AS k FROM unnest($1::text[], $2::text[]) AS u(h, kx)) k
CROSS JOIN LATERAL (SELECT id, message_uuid, topic, dead_letter_id, payload, parked_at FROM millwright_parked_messages
    WHERE handler = k.h AND key = k.k ORDER BY id LIMIT 1) m`, handlers, hx), func(r Row) error {
		var (
			h         ParkedHead
			lane, uid []byte
		)
		if err := r.Scan(&h.Handler, &lane, &h.ID, &uid, &h.Topic, &h.DeadLetterID, &h.Bytes, &h.ParkedAt); err != nil {
			return err
		}
		h.Key, h.MessageUUID = string(lane), string(uid)
		out = append(out, h)
		return nil
	})
	return out, err
}
