package storage

import (
	"encoding/json"
	"errors"
	"testing"
)

// FuzzCheckJSONB: CheckJSONB never panics, and refuses only valid JSON
// (whatever is not JSON is left to the server) with ErrJSONBRefuses.
// Agreement with the server is storagetest's CheckJSONBAgreesWithTheServer.
func FuzzCheckJSONB(f *testing.F) {
	for _, s := range []string{`{"a":"\u0000"}`, `["\ud800"]`, `{"n":1e131072}`, `"\ud83d\ude00"`, `-`, `1e`, `"\u12`, `{"a":`,
		`[[[[]]]]`, `{"\\u0000":0.5e-16383}`, `0e2000000000`, `{"a":1,"b":[true,false,null,"x"]}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		err := CheckJSONB(data)
		if err == nil {
			return
		}
		if !errors.Is(err, ErrJSONBRefuses) {
			t.Fatalf("%q: %v does not wrap ErrJSONBRefuses", data, err)
		}
		if !json.Valid(data) {
			t.Fatalf("%q is not JSON, yet refused: %v", data, err)
		}
	})
}
