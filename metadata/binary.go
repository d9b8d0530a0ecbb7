package metadata

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"unicode/utf8"
)

// BinaryEntries is the metadata key under which the outbox carries the
// entries of a message whose key or value is not text: a binary Kafka key
// or header of a dead letter being replayed. The outbox stores metadata as
// text (JSONB), so dlq's replay packs those entries here (PackBinary) and
// the relay restores them, byte for byte, before it publishes
// (UnpackBinary): the consumer never sees this key. A relay of another
// kind (Debezium) publishes it as it is.
const BinaryEntries = "millwright_binary_metadata"

// IsText reports whether s can be stored as Postgres text: valid UTF-8
// without a NUL byte.
func IsText(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// PackBinary returns a copy of md whose entries that are not text (key or
// value, IsText) are moved, encoded, under BinaryEntries; md is returned
// as it is when every entry is text. The encoding is base64 (standard) of
// each entry's key and value, each preceded by its length as an unsigned
// varint, in key order.
func PackBinary(md map[string]string) map[string]string {
	var packed []byte
	for _, k := range slices.Sorted(maps.Keys(md)) {
		if IsText(k) && IsText(md[k]) {
			continue
		}
		packed = binary.AppendUvarint(packed, uint64(len(k)))
		packed = append(packed, k...)
		packed = binary.AppendUvarint(packed, uint64(len(md[k])))
		packed = append(packed, md[k]...)
	}
	if packed == nil {
		return md
	}
	out := make(map[string]string, len(md))
	for k, v := range md {
		if IsText(k) && IsText(v) {
			out[k] = v
		}
	}
	out[BinaryEntries] = base64.StdEncoding.EncodeToString(packed)
	return out
}

// ErrBinaryEntries is returned (wrapped) by UnpackBinary for a
// BinaryEntries value it cannot decode (only a hand-edited row has one).
var ErrBinaryEntries = errors.New("metadata: malformed " + BinaryEntries)

// UnpackBinary restores in md the entries PackBinary packed under
// BinaryEntries, and removes that key. A value it cannot decode is left in
// md, and the error (ErrBinaryEntries) says why; md is then unchanged.
func UnpackBinary(md map[string]string) error {
	enc, ok := md[BinaryEntries]
	if !ok {
		return nil
	}
	raw, err := base64.StdEncoding.DecodeString(enc)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrBinaryEntries, err)
	}
	entries := map[string]string{}
	for len(raw) > 0 {
		var kv [2]string
		for i := range kv {
			n, w := binary.Uvarint(raw)
			if w <= 0 || n > uint64(len(raw)-w) {
				return fmt.Errorf("%w: a length runs past its end", ErrBinaryEntries)
			}
			kv[i] = string(raw[w : w+int(n)])
			raw = raw[w+int(n):]
		}
		entries[kv[0]] = kv[1]
	}
	delete(md, BinaryEntries)
	maps.Copy(md, entries)
	return nil
}
