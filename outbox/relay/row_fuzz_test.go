package relay

import (
	"database/sql"
	"reflect"
	"testing"

	"github.com/millwright/millwright/metadata"
)

// FuzzRowMessage feeds rows as they could be read back from the table
// (including hand-written ones): no panic, the message always carries the
// row's event id, and the payload comes through byte for byte.
func FuzzRowMessage(f *testing.F) {
	f.Add("e-1", "order", "o-1", true, `{"a":1}`, []byte(nil), `{"ce_id":"e-1","ordering_key":"order/o-1"}`)
	f.Add("e-2", "", "", false, "", []byte{0, 1, 2}, `{}`)
	f.Add("e-3", "order", "o-3", false, "", []byte("x"), `not json`)
	f.Add("e-4", "order", "o-4", true, `"s"`, []byte(nil), `{"ce_id":"forged","n":1}`)
	f.Add("e-5", "t", "a", true, `[]`, []byte(nil), `null`)
	f.Fuzz(func(t *testing.T, eventID, aggType, aggID string, valid bool, payload string, raw []byte, md string) {
		row := storedRow{eventID: eventID, aggType: aggType, aggID: aggID, payload: sql.NullString{String: payload, Valid: valid}, raw: raw, metadata: md}
		msg, err := rowMessage(row)
		// The claim's cache of the metadata column changes nothing, on a
		// miss or a hit, and a message does not alter what it caches.
		var cache metaCache
		for range 2 {
			cached, cerr := rowMessageCached(row, &cache)
			if (cerr == nil) != (err == nil) || !reflect.DeepEqual(cached.Metadata, msg.Metadata) {
				t.Fatalf("cached metadata %v (%v), uncached %v (%v)", cached.Metadata, cerr, msg.Metadata, err)
			}
			cached.Metadata.Set("mutated", "x")
		}
		if msg == nil || msg.Metadata == nil {
			t.Fatal("nil message or metadata")
		}
		if msg.UUID != eventID || msg.Metadata.Get(metadata.EventID) != eventID {
			t.Fatalf("event id not kept: uuid %q, metadata %q, row %q", msg.UUID, msg.Metadata.Get(metadata.EventID), eventID)
		}
		want := string(raw)
		if valid {
			want = payload
		}
		if string(msg.Payload) != want {
			t.Fatalf("payload changed: %q -> %q", want, msg.Payload)
		}
		if aggID != "" && msg.Metadata.Get(metadata.OrderingKey) == "" {
			t.Fatal("aggregate row without an ordering key")
		}
	})
}
