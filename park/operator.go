package park

import (
	"context"
	"fmt"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Reads for operator tools that run in a transaction of their own (the
// operator console's, with its SET LOCAL search_path): the Store's List
// and KeyMessages on a postgres.Handle, the head messages of a page of
// keys, and the parked key of a dead letter.

// ListTx is Store.List on db or in the caller's transaction.
func ListTx(ctx context.Context, db postgres.Handle, f Filter) ([]Key, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("park: ListTx: %w", err)
	}
	lane := ""
	if f.Key != "" {
		lane = storage.ParkLane(f.Key, f.Keyless)
	}
	rows, err := storage.ListParked(ctx, q, f.Handler, lane, f.Limit)
	if err != nil {
		return nil, fmt.Errorf("park: listing parked keys%s: %w", storage.Hint(err), err)
	}
	out := make([]Key, 0, len(rows))
	for _, r := range rows {
		out = append(out, keyOf(r))
	}
	return out, nil
}

func keyOf(r storage.ParkedKey) Key {
	key, keyless := storage.SplitParkLane(r.Key)
	return Key{Handler: r.Handler, Key: key, Keyless: keyless, Messages: r.Messages, DueAt: r.DueAt, Held: r.Held,
		Attempts: r.Attempts, Rounds: r.Rounds, FirstFailure: r.FirstFailure.Time, LastFailure: r.LastFailure.Time,
		LastError: r.LastError, DeadLetterID: r.DeadLetterID.Int64, ParkedSince: r.CreatedAt}
}

// KeyMessagesTx is Store.KeyMessages on db or in the caller's transaction.
func KeyMessagesTx(ctx context.Context, db postgres.Handle, k Key) ([]Message, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("park: KeyMessagesTx: %w", err)
	}
	rows, err := storage.ListParkedMessages(ctx, q, k.Handler, k.lane())
	if err != nil {
		return nil, fmt.Errorf("park: listing the parked messages of %s%s: %w", k, storage.Hint(err), err)
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

// Head is a parked key's head message as a list shows it: without its
// payload, whose size is Bytes.
type Head struct {
	ID           int64
	UUID, Topic  string
	Bytes        int
	DeadLetterID int64
	ParkedAt     time.Time
	Found        bool
}

// HeadsTx returns the head message of each of keys, in keys' order, in
// one statement on db or in the caller's transaction; a key whose last
// message went meanwhile has a Head with Found false.
func HeadsTx(ctx context.Context, db postgres.Handle, keys []Key) ([]Head, error) {
	out := make([]Head, len(keys))
	if len(keys) == 0 {
		return out, nil
	}
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("park: HeadsTx: %w", err)
	}
	handlers, lanes := make([]string, len(keys)), make([]string, len(keys))
	at := make(map[[2]string]int, len(keys))
	for i, k := range keys {
		handlers[i], lanes[i] = k.Handler, k.lane()
		at[[2]string{handlers[i], lanes[i]}] = i
	}
	heads, err := storage.ParkedHeads(ctx, q, handlers, lanes)
	if err != nil {
		return nil, fmt.Errorf("park: reading the head messages of %d parked keys%s: %w", len(keys), storage.Hint(err), err)
	}
	for _, h := range heads {
		if i, ok := at[[2]string{h.Handler, h.Key}]; ok {
			out[i] = Head{ID: h.ID, UUID: h.MessageUUID, Topic: h.Topic, Bytes: h.Bytes, DeadLetterID: h.DeadLetterID,
				ParkedAt: h.ParkedAt.Time, Found: true}
		}
	}
	return out, nil
}

// DeadLetterKeyTx returns the parked key a dead letter belongs to, on db
// or in the caller's transaction: the key of handler whose head (or a
// parked message) is dead letter id, else handler's parked key key (the
// dead letter's key, Config.Key of its message, when the caller knows
// it; "" to skip). found is false when neither is parked, or when the
// schema has no park tables (only the dlq was migrated): a dead letter
// without a parked key is not an error.
func DeadLetterKeyTx(ctx context.Context, db postgres.Handle, handler string, id int64, key string) (k Key, found bool, err error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return Key{}, false, fmt.Errorf("park: DeadLetterKeyTx: %w", err)
	}
	if ok, err := storage.ParkTablesExist(ctx, q); err != nil || !ok {
		return Key{}, false, err
	}
	lane, found, err := storage.ParkedLaneOfDeadLetter(ctx, q, handler, id)
	if err != nil {
		return Key{}, false, fmt.Errorf("park: finding the parked key of dead letter %d: %w", id, err)
	}
	if !found {
		if key == "" {
			return Key{}, false, nil
		}
		lane = storage.ParkLane(key, false)
	}
	rows, err := storage.ListParked(ctx, q, handler, lane, 1)
	if err != nil {
		return Key{}, false, fmt.Errorf("park: reading the parked key of dead letter %d: %w", id, err)
	}
	if len(rows) == 0 {
		return Key{}, false, nil
	}
	return keyOf(rows[0]), true, nil
}
