package cloudevent_test

import (
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/metadata"
)

// maxErrorBytes bounds a validation error: hostile attribute values are
// quoted, but not whole.
const maxErrorBytes = 4096

// FuzzValidate feeds hostile CloudEvents attributes to Validate and
// FromMessage: no panic; every refusal names the metadata key; the error
// stays bounded whatever the values' size; what is accepted survives Apply
// and FromMessage again unchanged.
func FuzzValidate(f *testing.F) {
	f.Add("evt-1", "/orders-service", "order.created.v1", "1.0", "2026-01-02T15:04:05Z", "o-1", "application/json", uint8(0))
	f.Add("", "", "", "", "", "", "", uint8(0xff))
	f.Add("e", "http://[::1", " order.created.v1 ", "0.3", "yesterday", "", "json", uint8(0))
	f.Add("e", "%zz", "t", "1.0", "2026-13-45T99:99:99Z", "\x00", "text/plain; charset=\xff", uint8(0))
	f.Add(strings.Repeat("x", 100000), "/"+strings.Repeat("s", 100000)+"%", " "+strings.Repeat("t", 100000), strings.Repeat("9", 100000),
		strings.Repeat("2", 100000), "s", strings.Repeat("a", 100000), uint8(0))
	f.Fuzz(func(t *testing.T, id, source, typ, specVersion, at, subject, contentType string, unset uint8) {
		msg := message.NewMessage("m-1", nil)
		for i, kv := range [][2]string{
			{metadata.EventID, id}, {metadata.EventSource, source}, {metadata.EventType, typ},
			{metadata.EventSpecVersion, specVersion}, {metadata.EventTime, at}, {metadata.EventSubject, subject},
			{metadata.EventDataContentType, contentType},
		} {
			if unset&(1<<i) == 0 {
				msg.Metadata.Set(kv[0], kv[1])
			}
		}
		a, err := cloudevent.FromMessage(msg)
		if verr := cloudevent.Validate(msg); (verr == nil) != (err == nil) {
			t.Fatalf("Validate and FromMessage disagree: %v / %v", verr, err)
		}
		if err != nil {
			if len(err.Error()) > maxErrorBytes {
				t.Fatalf("error of %d bytes: hostile values quoted whole", len(err.Error()))
			}
			for _, line := range strings.Split(err.Error(), "\n") {
				if !strings.Contains(line, "metadata ce_") {
					t.Fatalf("error line does not name the metadata key: %q", line)
				}
			}
			return
		}
		again := message.NewMessage("m-2", nil)
		a.Apply(again)
		b, err := cloudevent.FromMessage(again)
		if err != nil {
			t.Fatalf("accepted attributes %+v do not validate after Apply: %v", a, err)
		}
		if !a.Time.Equal(b.Time) {
			t.Fatalf("time changed: %v -> %v", a.Time, b.Time)
		}
		a.Time, b.Time = time.Time{}, time.Time{}
		if a != b {
			t.Fatalf("attributes changed by Apply/FromMessage: %+v -> %+v", a, b)
		}
	})
}

// FuzzParseType: no panic, and an accepted type is rebuilt exactly by Type.
func FuzzParseType(f *testing.F) {
	for _, s := range []string{"order.created.v1", "order.created.v0", "x.v01", ".v1", "v1", "a.v-1", "a.v99999999999999999999", "a.v+1", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, typ string) {
		name, v, ok := cloudevent.ParseType(typ)
		if !ok {
			return
		}
		if v < 1 || name == "" || cloudevent.Type(name, v) != typ {
			t.Fatalf("ParseType(%q) = %q, %d: Type gives %q", typ, name, v, cloudevent.Type(name, v))
		}
	})
}

// FuzzBindingDecode renames hostile wire keys: no panic, the same input
// always gives the same output (colliding keys such as "ce-ID" and "ce-id"
// on case-insensitive Pub/Sub must not depend on map order), and no key
// that is still a wire-form attribute is left behind.
func FuzzBindingDecode(f *testing.F) {
	f.Add("ce-ID", "a", "ce-id", "b", "Content-Type", "c", uint8(2))
	f.Add("ce_ID", "a", "ce_Id", "b", "ce_id", "c", uint8(0))
	f.Add("cloudEvents:id", "a", "cloudEvents_id", "b", "x", "c", uint8(1))
	f.Add("content-type", "a", "ce_datacontenttype", "b", "ce_", "c", uint8(0))
	bindings := []cloudevent.Binding{cloudevent.Kafka, cloudevent.AMQP, cloudevent.PubSub}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2, k3, v3 string, which uint8) {
		b := bindings[int(which)%len(bindings)]
		in := map[string]string{k1: v1, k2: v2, k3: v3}
		var first map[string]string
		for range 8 {
			md := maps.Clone(in)
			b.Decode(md)
			if first == nil {
				first = md
				continue
			}
			if !maps.Equal(first, md) {
				t.Fatalf("Decode(%q) is not deterministic: %q vs %q", in, first, md)
			}
		}
		for k := range first {
			if mk := b.MetadataKey(k); mk != k {
				if _, both := first[mk]; !both {
					t.Fatalf("key %q left in wire form (metadata key %q) in %q", k, mk, first)
				}
			}
		}
	})
}
