package dlq

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"strings"
	"unicode/utf8"

	"github.com/millwright/millwright/internal/linediff"
	"github.com/millwright/millwright/internal/redact"
)

// DiffLine is one line of a line diff: Op is " " (kept), "-" (removed) or
// "+" (added).
type DiffLine struct{ Op, Text string }

// LineDiff is the line diff of a and b (longest common subsequence,
// bounded: past 4,000,000 cells every old line is removed and every new
// one added): what the console's edit preview shows, and what EditChange
// keeps in the audit row.
func LineDiff(a, b string) []DiffLine {
	d := linediff.Diff(a, b)
	out := make([]DiffLine, len(d))
	for i, l := range d {
		out[i] = DiffLine{Op: string(l.Op), Text: l.Text}
	}
	return out
}

// maxChangeBytes bounds the change an audit row keeps of an edit.
const maxChangeBytes = 32 << 10

// EditChange is what an edit changes in dead letter d, as its audit row
// keeps it (audit.Entry.Change): a line diff of the payload as the
// console shows it (JSON pretty-printed, text, or a hex dump), URL
// passwords and secret-named parameters masked, then, when the edit sets
// the metadata, a line diff of the metadata as a JSON object whose values
// of secret-named keys are masked (as the dead letter's page shows them).
// Three unchanged lines are kept around each change; the text is cut at
// 32 KiB. "" when e changes nothing.
func EditChange(d DeadLetter, e Edit) string {
	var b strings.Builder
	if before, after := shownPayload(d.Payload), shownPayload(e.Payload); before != after {
		b.WriteString("payload:\n")
		b.WriteString(linediff.Unified(linediff.Diff(before, after), 3))
	}
	if e.Metadata != nil {
		if before, after := shownMetadata(d.Metadata), shownMetadata(e.Metadata); before != after {
			b.WriteString("metadata:\n")
			b.WriteString(linediff.Unified(linediff.Diff(before, after), 3))
		}
	}
	s := b.String()
	if len(s) > maxChangeBytes {
		cut := maxChangeBytes
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + "\n… (the change is cut at 32 KiB)\n"
	}
	return s
}

// shownPayload is a payload as the console shows it, secrets in text
// masked.
func shownPayload(p []byte) string {
	var buf bytes.Buffer
	switch {
	case len(p) > 0 && json.Valid(p) && json.Indent(&buf, p, "", "  ") == nil:
		return redact.Text(buf.String())
	case utf8.Valid(p) && !bytes.ContainsRune(p, 0):
		return redact.Text(string(p))
	}
	return hex.Dump(p)
}

// shownMetadata is metadata as the console's edit form shows it: a JSON
// object, keys sorted, values masked by RedactedValue.
func shownMetadata(md map[string]string) string {
	shown := make(map[string]string, len(md))
	for k, v := range md {
		shown[Printable(k)] = RedactedValue(k, v)
	}
	out, _ := json.MarshalIndent(shown, "", "  ") // a map of strings always encodes
	return string(out)
}
