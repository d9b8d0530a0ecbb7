package saga

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
)

type fuzzOrder struct {
	ID     string `json:"id"`
	Amount int    `json:"amount"`
}

func fuzzOrchestrator(t testing.TB) *Orchestrator[fuzzOrder] {
	t.Helper()
	cmd := func(o fuzzOrder) (Command, error) { return Command{Topic: "t", Type: "c.v1", Payload: o}, nil }
	def, err := Define("orders",
		Step[fuzzOrder]{Name: "reserve", Command: cmd, Compensation: cmd},
		Step[fuzzOrder]{Name: "charge", Command: cmd, NoCompensation: true})
	if err != nil {
		t.Fatal(err)
	}
	return &Orchestrator[fuzzOrder]{def: def, d: decider[fuzzOrder]{def: def}}
}

// storable reports whether Postgres accepts s in a TEXT column: valid
// UTF-8 without NUL.
func storable(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

// FuzzParseReply feeds reply metadata and payloads to the reply parser:
// it must not panic, must name the metadata key it refuses, and whatever
// it accepts must be storable in the saga tables (a saga id or failure
// text Postgres refuses would fail the reply on every redelivery).
func FuzzParseReply(f *testing.F) {
	f.Add("o-1", "orders", "reserve", PhaseForward, "1", "reserve.succeeded", "", "", []byte(`{}`))
	f.Add("o-1", "", "charge", PhaseForward, "2", "", "charge.failed", "card declined", []byte(`{"reason":"declined"}`))
	f.Add("o-1", "orders", "reserve", PhaseCompensation, "1", "reserve.compensation_failed", "", "", []byte("\xff\xfe binary \x00"))
	f.Add("o\x00-1", "orders", "reserve", PhaseForward, "1", "reserve.failed", "", "err\x00\xff", []byte(strings.Repeat("é", 600)))
	f.Add("", "orders", "nope", "sideways", "-1", "x", "", "", []byte(nil))
	f.Add("o-1", "invoices", "reserve", PhaseForward, "99999999999999999999", "reserve.failed", "", "", []byte(nil))
	o := fuzzOrchestrator(f)
	f.Fuzz(func(t *testing.T, sagaID, typ, step, phase, attempt, replyType, eventType, sagaErr string, payload []byte) {
		msg := message.NewMessage("r-1", payload)
		set := func(k, v string) {
			if v != "" {
				msg.Metadata.Set(k, v)
			}
		}
		set(metadata.SagaID, sagaID)
		set(metadata.SagaType, typ)
		set(metadata.SagaStep, step)
		set(metadata.SagaPhase, phase)
		set(metadata.SagaAttempt, attempt)
		set(metadata.SagaReplyType, replyType)
		set(metadata.EventType, eventType)
		set(metadata.SagaError, sagaErr)
		r, err := o.d.parseReply(msg)
		if err != nil {
			if !strings.Contains(err.Error(), "saga orders") {
				t.Fatalf("error does not name the saga type: %v", err)
			}
			return
		}
		if !storable(r.sagaID) {
			t.Fatalf("accepted saga id %q that Postgres cannot store", r.sagaID)
		}
		if r.attempt < 1 || r.stepIdx < 0 || r.stepIdx >= len(o.def.steps) {
			t.Fatalf("accepted attempt %d step %d", r.attempt, r.stepIdx)
		}
		e := replyError(r.reply)
		if !storable(e) {
			t.Fatalf("failure text %q cannot be stored", e)
		}
		if len(e) > maxReplyErrorBytes+len("...") {
			t.Fatalf("failure text of %d bytes: want at most %d", len(e), maxReplyErrorBytes)
		}
	})
}

// FuzzDecodeData decodes stored saga data: never a panic, and an error
// names the saga and the Go type.
func FuzzDecodeData(f *testing.F) {
	f.Add([]byte(`{"id":"o-1","amount":3}`))
	f.Add([]byte(`{"amount":"three"}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"id":`))
	f.Add([]byte("\x00\xff"))
	f.Add([]byte(`{"amount":1e400}`))
	o := fuzzOrchestrator(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := o.d.decode(instance{id: "o-1", data: data})
		if err != nil {
			if !strings.Contains(err.Error(), `saga orders "o-1": decoding data into saga.fuzzOrder`) {
				t.Fatalf("error does not name the saga and type: %v", err)
			}
			return
		}
		if _, err := json.Marshal(d); err != nil {
			t.Fatalf("decoded data does not encode again: %v", err)
		}
	})
}

func TestReplyErrorIsStorable(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	db.DB.SetMaxOpenConns(1)
	long := strings.Repeat("é", 1000) // 2,000 bytes: a cut at 1,024 would split a rune
	for _, r := range []Reply{
		{Type: "x.failed", Payload: []byte(long)},
		{Type: "x.failed", Payload: []byte("\xff\x00binary")},
		{Type: "x.failed", Metadata: map[string]string{metadata.SagaError: "bad\x00\xfe" + strconv.Itoa(1)}},
	} {
		e := replyError(r)
		if !storable(e) {
			t.Fatalf("replyError(%q) = %q: not storable", r.Payload, e)
		}
		var back string
		if err := db.DB.QueryRow(`SELECT $1::text`, e).Scan(&back); err != nil {
			t.Fatalf("Postgres refuses replyError(%q) = %q: %v", r.Payload, e, err)
		}
	}
	// The predicate the fuzzer checks is Postgres's rule.
	for _, bad := range []string{"a\x00b", "\xff"} {
		if storable(bad) {
			t.Fatalf("storable(%q)", bad)
		}
		if _, err := db.DB.Exec(`SELECT $1::text`, bad); err == nil {
			t.Fatalf("Postgres accepted %q", bad)
		}
	}
}
