package console

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
)

// The parked keys page: the keys package park holds (after a dead letter,
// under park.Hold) or retries, their head messages and errors, and the
// operator's retry, release and skip, each the function `millwright
// parked` runs (park.RetryTx, ReleaseTx, SkipTx) in the console's
// transaction, with its audit row.

// parkedKeyView is one parked key as the pages show it.
type parkedKeyView struct {
	park.Key
	Head park.Head
	// Shown is the key as text: itself, hex:... for a binary key, "(no
	// key) UUID" for a message parked without a key (as `parked list`).
	Shown string
	// KeyArg, HexArg and KeylessArg name the key in a link or a form.
	KeyArg, HexArg, KeylessArg string
	// Waiting counts the messages behind the head.
	Waiting int64
}

// State is "held" (its head is a dead letter; nothing of the key runs
// until an operator acts) or "retrying".
func (v parkedKeyView) State() string {
	if v.Held {
		return "held"
	}
	return "retrying"
}

func newParkedKeyView(k park.Key, head park.Head) parkedKeyView {
	v := parkedKeyView{Key: k, Head: head, Waiting: max(k.Messages-1, 0)}
	switch {
	case k.Keyless:
		v.Shown, v.KeyArg, v.KeylessArg = "(no key) "+k.Key, k.Key, "1"
	case isTextKey(k.Key):
		v.Shown, v.KeyArg = k.Key, k.Key
	default:
		v.KeyArg, v.HexArg = hex.EncodeToString([]byte(k.Key)), "1"
		v.Shown = "hex:" + v.KeyArg
	}
	v.Head.UUID = dlq.Printable(head.UUID)
	return v
}

// isTextKey reports whether key shows as itself: UTF-8 without control
// characters.
func isTextKey(key string) bool {
	if !utf8.ValidString(key) {
		return false
	}
	return strings.IndexFunc(key, unicode.IsControl) < 0
}

// parkedStates are the state filter's values.
var parkedStates = []string{"", "held", "retrying"}

type parkedData struct {
	Handler, State, Key string
	States              []string
	Keys                []parkedKeyView
	// Scanned counts the keys read for the page (the state filter is
	// applied to them), Limit caps it.
	Scanned, Limit int
	Missing        bool
}

// parkedScan caps the keys a page reads: held ones come first, then by
// due time.
const parkedScan = 1000

func (h *Handler) parked(ctx context.Context, q *req) error {
	d := parkedData{Handler: q.FormValue("handler"), State: q.FormValue("state"), Key: q.FormValue("key"),
		States: parkedStates, Limit: parkedScan}
	switch d.State {
	case "", "held", "retrying":
	default:
		return badRequest("state %q: want held, retrying or nothing (every parked key)", d.State)
	}
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		keys, err := park.ListTx(ctx, tx, park.Filter{Handler: d.Handler, Key: d.Key, Limit: parkedScan})
		if err != nil {
			return fmt.Errorf("schema %s: %w", q.schema, err)
		}
		d.Scanned = len(keys)
		var picked []park.Key
		for _, k := range keys {
			if d.State == "" || (d.State == "held") == k.Held {
				picked = append(picked, k)
			}
			if len(picked) == listLimit {
				break
			}
		}
		heads, err := park.HeadsTx(ctx, tx, picked)
		if err != nil {
			return err
		}
		for i, k := range picked {
			d.Keys = append(d.Keys, newParkedKeyView(k, heads[i]))
		}
		return nil
	})
	if err != nil {
		return err
	}
	return h.render(q, "parked.html", &view{Title: "Parked keys", Nav: "parked", Data: d})
}

// formKey reads the key a link or form names: handler, key, and hex=1
// (key is the key's bytes in hex) or keyless=1 (key is the UUID of a
// message parked without a key).
func formKey(q *req) (park.Key, error) {
	k := park.Key{Handler: q.FormValue("handler"), Key: q.FormValue("key"), Keyless: q.FormValue("keyless") == "1"}
	if k.Handler == "" {
		return k, badRequest("no handler: a parked key is named by its handler and key (follow a link of the parked keys page)")
	}
	if k.Key == "" {
		return k, badRequest("no key: a parked key is named by its handler and key (follow a link of the parked keys page)")
	}
	if q.FormValue("hex") == "1" {
		if k.Keyless {
			return k, badRequest("hex=1 and keyless=1 exclude each other")
		}
		b, err := hex.DecodeString(k.Key)
		if err != nil {
			return k, badRequest("key %q: hex=1 says it is hex, and it is not: %v", k.Key, err)
		}
		k.Key = string(b)
	}
	return k, nil
}

// keyPage is a parked key with its messages.
type keyPage struct {
	Key      parkedKeyView
	Messages []parkedMessageView
}

type parkedMessageView struct {
	park.Message
	Bytes int
}

// loadKey reads k's current state and head in tx; not parked is a 404.
func loadKey(ctx context.Context, tx postgres.Tx, q *req, k park.Key) (parkedKeyView, error) {
	keys, err := park.ListTx(ctx, tx, park.Filter{Handler: k.Handler, Key: k.Key, Keyless: k.Keyless, Limit: 1})
	if err != nil {
		return parkedKeyView{}, fmt.Errorf("schema %s: %w", q.schema, err)
	}
	if len(keys) == 0 {
		return parkedKeyView{}, notFound("%s is not parked in schema %s (any more: released, or its messages applied); see the parked keys page", k, q.schema)
	}
	heads, err := park.HeadsTx(ctx, tx, keys)
	if err != nil {
		return parkedKeyView{}, err
	}
	return newParkedKeyView(keys[0], heads[0]), nil
}

func (h *Handler) parkedKey(ctx context.Context, q *req) error {
	k, err := formKey(q)
	if err != nil {
		return err
	}
	var d keyPage
	err = h.read(ctx, q, func(tx postgres.Tx) error {
		if d.Key, err = loadKey(ctx, tx, q, k); err != nil {
			return err
		}
		msgs, err := park.KeyMessagesTx(ctx, tx, d.Key.Key)
		for _, m := range msgs {
			n := len(m.Payload)
			m.UUID, m.Payload = dlq.Printable(m.UUID), nil
			d.Messages = append(d.Messages, parkedMessageView{Message: m, Bytes: n})
		}
		return err
	})
	if err != nil {
		return err
	}
	return h.render(q, "parkedkey.html", &view{Title: "Parked key " + d.Key.Shown, Nav: "parked", Data: d})
}

// parkedOps are the operator's actions on a parked key: what each does,
// as the dry run says it (`millwright parked`'s words).
var parkedOps = map[string]string{
	"retry":   "run the head again now, with a fresh budget, then the key's %d later message(s) in order",
	"release": "drop the head (its dead letter stays in the DLQ, replayable later, out of order) and go on with the key's %d later message(s)",
	"skip":    "dead-letter the head (unless it is already: it stays in the DLQ, replayable later, out of order) and go on with the key's %d later message(s)",
}

type parkedActionData struct {
	Op, What string
	Key      parkedKeyView
	Force    bool
	Group    string
	// Done is set after the action; DeadLetterID is the skipped head's.
	Done         bool
	DeadLetterID int64
}

// parkedAction is the dry run (step=preview) of retry, release or skip
// of a key, and confirmed (step=confirm) the action itself: the same
// function `millwright parked` calls, in a transaction with the audit
// row. The confirmation carries the head the dry run showed; a key whose
// head changed meanwhile (applied, released by someone else) is refused,
// so the operator acts on what they saw.
func (h *Handler) parkedAction(ctx context.Context, q *req) error {
	op := q.PostForm.Get("op")
	what, ok := parkedOps[op]
	if !ok {
		return badRequest("action %q: want retry, release or skip", op)
	}
	// Retry and release resume the key's own messages (an operator's);
	// skip dead-letters its head and goes on without it (an admin's, as
	// discarding is).
	if need := parkedNeed(op); !q.role.Allows(need) {
		return &httpError{status: http.StatusForbidden, msg: fmt.Sprintf("refused: %s of a parked key needs the %s role; %s is %s", op, need, q.actor, article(q.role))}
	}
	k, err := formKey(q)
	if err != nil {
		return err
	}
	d := parkedActionData{Op: op, Force: q.PostForm.Get("force") == "1", Group: strings.TrimSpace(q.PostForm.Get("consumer_group"))}
	check := func(cur parkedKeyView) error {
		if op == "release" && !cur.Held && !d.Force {
			return badRequest("%s is not held: its head is still being retried and is not in the DLQ; wait, retry it, skip it (dead-letter it and go on), or release with force to drop it (lost)", cur.Key)
		}
		return nil
	}
	if q.PostForm.Get("step") != "confirm" {
		err := h.read(ctx, q, func(tx postgres.Tx) error {
			var err error
			d.Key, err = loadKey(ctx, tx, q, k)
			return err
		})
		if err != nil {
			return err
		}
		if err := check(d.Key); err != nil {
			return err
		}
		d.What = fmt.Sprintf(what, d.Key.Waiting)
		if op == "release" && d.Force && !d.Key.Held {
			d.What = fmt.Sprintf("drop the head, which is NOT in the DLQ (it is lost), and go on with the key's %d later message(s)", d.Key.Waiting)
		}
		return h.render(q, "parkedaction.html", &view{Title: "Parked key: " + op + " (dry run)", Nav: "parked", Data: d})
	}
	seen, err := strconv.ParseInt(q.PostForm.Get("head"), 10, 64)
	if err != nil {
		return badRequest("head %q: the confirmation names the head message its dry run showed; start from the key's page", q.PostForm.Get("head"))
	}
	err = h.write(ctx, q, func(tx postgres.Tx) error {
		cur, err := loadKey(ctx, tx, q, k)
		if err != nil {
			return err
		}
		if cur.Head.ID != seen {
			return &httpError{status: http.StatusConflict, msg: fmt.Sprintf("%s changed since the dry run: its head was parked message %d and is now %d (applied, released or skipped meanwhile); nothing was done: review the key again", cur.Key, seen, cur.Head.ID)}
		}
		if err := check(cur); err != nil {
			return err
		}
		d.Key = cur
		switch op {
		case "retry":
			err = park.RetryTx(ctx, tx, cur.Key)
		case "release":
			err = park.ReleaseTx(ctx, tx, cur.Key, d.Force)
		case "skip":
			d.DeadLetterID, err = park.SkipTx(ctx, tx, cur.Key, park.SkipOptions{ConsumerGroup: d.Group})
		}
		if errors.Is(err, park.ErrNotParked) {
			return &httpError{status: http.StatusConflict, msg: err.Error() + "; nothing was done"}
		}
		if err != nil {
			return err
		}
		args := []string{"--schema=" + q.schema, "--handler=" + cur.Handler, "--head=" + strconv.FormatInt(seen, 10)}
		switch {
		case cur.Keyless:
			args = append(args, "--no-key", cur.KeyArg)
		case cur.HexArg != "":
			args = append(args, "--hex", cur.KeyArg)
		default:
			args = append(args, cur.KeyArg)
		}
		if d.Force {
			args = append(args, "--force")
		}
		if d.Group != "" {
			args = append(args, "--consumer-group="+d.Group)
		}
		return h.audit(ctx, tx, q, "console parked "+op, args, 1)
	})
	if err != nil {
		return err
	}
	d.Done, d.What = true, fmt.Sprintf(what, d.Key.Waiting)
	return h.render(q, "parkedaction.html", &view{Title: "Parked key: " + op + " done", Nav: "parked", Data: d})
}

// deadLetterParked is the parked key of dead letter row, if it has one:
// the key whose head it is, else its key (park.DefaultKey of its
// message) when that is parked for its handler. A failure to read it is
// shown on the page, not raised: the dead letter is still worth showing.
func (h *Handler) deadLetterParked(ctx context.Context, q *req, row dlq.DeadLetter) (*letterParked, string) {
	if row.Handler == "" {
		return nil, ""
	}
	msg := message.NewMessage(row.MessageUUID, nil)
	for k, v := range row.Metadata {
		msg.Metadata.Set(k, v)
	}
	var out *letterParked
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		k, found, err := park.DeadLetterKeyTx(ctx, tx, row.Handler, row.ID, park.DefaultKey(msg))
		if err != nil || !found {
			return err
		}
		heads, err := park.HeadsTx(ctx, tx, []park.Key{k})
		if err != nil {
			return err
		}
		v := newParkedKeyView(k, heads[0])
		links := &view{Base: h.cfg.BasePath, Schema: q.schema}
		out = &letterParked{Key: v, ID: row.ID,
			URL:     links.URL("/parked/key", "handler", v.Handler, "key", v.KeyArg, "hex", v.HexArg, "keyless", v.KeylessArg),
			HeadURL: links.URL(fmt.Sprintf("/dead-letters/%d", v.Head.DeadLetterID))}
		return nil
	})
	if err != nil {
		return nil, dlq.Redacted(err.Error())
	}
	return out, ""
}

// letterParked is a dead letter's parked key, for its page.
type letterParked struct {
	Key          parkedKeyView
	ID           int64
	URL, HeadURL string
}

// parkedNeed is the role parked-key action op needs.
func parkedNeed(op string) Role {
	if op == "skip" {
		return RoleAdmin
	}
	return RoleOperator
}
