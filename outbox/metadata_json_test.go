package outbox

import (
	"encoding/json"
	"reflect"
	"testing"
)

// FuzzMetadataJSON: Add's encoder of the metadata column writes valid JSON
// that reads back as json.Marshal's output does (invalid UTF-8 as U+FFFD,
// control characters escaped), for any keys and values.
func FuzzMetadataJSON(f *testing.F) {
	f.Add("ce_source", "/orders-service", "traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	f.Add(`k"\`, "\x01\x1f\xff\xfe", "\u2028<>&", "é\u00e9\U0001F600")
	f.Add("", "", "\x00", "\xed\xa0\x80")
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string) {
		md := map[string]string{k1: v1, k2: v2}
		got := appendMetadataJSON(nil, md)
		if !json.Valid(got) {
			t.Fatalf("not JSON: %q", got)
		}
		var back, want map[string]string
		if err := json.Unmarshal(got, &back); err != nil {
			t.Fatal(err)
		}
		ref, err := json.Marshal(md)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(ref, &want); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(back, want) {
			t.Fatalf("reads back as %q, json.Marshal's as %q", back, want)
		}
	})
}

func TestMetadataJSONEmpty(t *testing.T) {
	if got := string(appendMetadataJSON(nil, nil)); got != "{}" {
		t.Fatalf("nil metadata: %q", got)
	}
}
