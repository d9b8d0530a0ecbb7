package console

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/postgres"
)

// stateDead is the state of a dead letter that can be replayed.
const stateDead = dlq.StateDead

// topicGroup sums the groups of one topic.
type topicGroup struct {
	Topic               string
	Count, Dead         int64
	FirstSeen, LastSeen time.Time
}

type deadLettersData struct {
	Topic, ErrorType, Query string
	All                     bool
	Topics                  []topicGroup
	Groups                  []dlq.Group
	Rows                    []dlq.DeadLetter
	Total                   int
	Limit                   int
	// Cause filters by fingerprint; Causes are the groups by fingerprint
	// (causes.go).
	Cause  string
	Causes []dlq.Cause
}

const listLimit = 200

func (h *Handler) deadLetters(ctx context.Context, q *req) error {
	d := deadLettersData{Topic: q.FormValue("topic"), ErrorType: q.FormValue("error_type"), Query: q.FormValue("q"),
		All: q.FormValue("all") == "1", Limit: listLimit, Cause: q.FormValue("cause")}
	f := dlq.Filter{Topic: d.Topic, ErrorType: d.ErrorType, ErrorContains: d.Query, Pending: !d.All, Fingerprint: d.Cause}
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		// The groups show every topic and error type (filtered by text
		// only), so that picking one does not hide the others.
		groups, err := dlq.Groups(ctx, tx, dlq.Filter{ErrorContains: d.Query, Pending: !d.All})
		if err != nil {
			return fmt.Errorf("schema %s: %w", q.schema, err)
		}
		d.Groups, d.Topics = groups, topicsOf(groups)
		if d.Causes, err = dlq.Causes(ctx, tx, dlq.Filter{ErrorContains: d.Query, Pending: !d.All}); err != nil {
			return err
		}
		if d.Total, err = dlq.Count(ctx, tx, f); err != nil {
			return err
		}
		f.Limit = listLimit
		d.Rows, err = dlq.List(ctx, tx, f)
		return err
	})
	if err != nil {
		return err
	}
	return h.render(q, "deadletters.html", &view{Title: "Dead letters", Nav: "dlq", Data: d})
}

func topicsOf(groups []dlq.Group) []topicGroup {
	var out []topicGroup
	for _, g := range groups {
		if len(out) == 0 || out[len(out)-1].Topic != g.Topic {
			out = append(out, topicGroup{Topic: g.Topic, FirstSeen: g.FirstSeen, LastSeen: g.LastSeen})
		}
		t := &out[len(out)-1]
		t.Count += g.Count
		t.Dead += g.Dead
		if g.FirstSeen.Before(t.FirstSeen) {
			t.FirstSeen = g.FirstSeen
		}
		if g.LastSeen.After(t.LastSeen) {
			t.LastSeen = g.LastSeen
		}
	}
	return out
}

// letterView is one dead letter as its page shows it.
type letterView struct {
	Row                dlq.DeadLetter
	Payload            payloadView
	CloudEvents, Trace []kv
	Headers            []kv
	Error, Stack       string
	Replayable         bool
	// ReplayFor is the consumer a replay is for (dlq.ReplayTarget of the
	// recorded consumer group and handler); "" when none is recorded and
	// every consumer group on the topic runs the replay.
	ReplayFor string
	metadata  map[string]string
	// Parked is the dead letter's parked key (parked.go), ParkedError why
	// it could not be read.
	Parked      *letterParked
	ParkedError string
}

// newLetterView reads the UUID and metadata of r from their lossless
// copies (dlq migration 005), shown quoted (Go syntax) where they are not
// text: a binary key or header.
func newLetterView(r dlq.DeadLetter) letterView {
	v := letterView{Row: r, Payload: viewPayload(r.Payload), Replayable: r.State == stateDead,
		ReplayFor: dlq.ReplayTarget(r.ConsumerGroup, r.Handler)}
	v.Row.MessageUUID = dlq.Printable(r.MessageUUID)
	md := r.Metadata
	v.metadata = md
	shown := make(map[string]string, len(md))
	for k, val := range md {
		shown[dlq.Printable(k)] = dlq.Printable(val)
	}
	v.CloudEvents, v.Trace, v.Headers = metadataView(shown)
	return v
}

func pathID(q *req) (int64, error) {
	id, err := strconv.ParseInt(q.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		return 0, badRequest("dead letter id %q: want a positive number", q.PathValue("id"))
	}
	return id, nil
}

func (h *Handler) loadLetter(ctx context.Context, q *req, id int64) (dlq.DeadLetter, error) {
	var row dlq.DeadLetter
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		var err error
		row, err = dlq.Get(ctx, tx, id)
		return err
	})
	if errors.Is(err, dlq.ErrNotFound) {
		return row, notFound("no dead letter %d in schema %s", id, q.schema)
	}
	return row, err
}

func (h *Handler) deadLetter(ctx context.Context, q *req) error {
	id, err := pathID(q)
	if err != nil {
		return err
	}
	row, err := h.loadLetter(ctx, q, id)
	if err != nil {
		return err
	}
	lv := newLetterView(row)
	lv.Parked, lv.ParkedError = h.deadLetterParked(ctx, q, row)
	return h.render(q, "deadletter.html", &view{Title: fmt.Sprintf("Dead letter %d", id), Nav: "dlq", Data: lv})
}

// editData is the edit form and its preview.
type editData struct {
	Letter       letterView
	Encoding     string
	Text         string
	Metadata     string
	Diff         []diffLine
	MetadataDiff []diffLine
	Changed      bool
	Preview      bool
	JSONNote     string
}

// shownValue is a metadata value as the console shows it: masked for a
// secret-named key, with URL passwords and secret parameters masked
// otherwise.
func shownValue(k, v string) string { return dlq.RedactedValue(k, v) }

// metadataText is metadata as the edit form shows it: a JSON object, keys
// sorted, values as shownValue shows them (a value left as shown keeps the
// stored one, see editedMetadata).
func metadataText(md map[string]string) string {
	shown := make(map[string]string, len(md))
	for k, v := range md {
		shown[k] = shownValue(k, v)
	}
	b, _ := json.MarshalIndent(shown, "", "  ") // a map of strings always encodes
	return string(b)
}

// editedMetadata decodes the form's metadata; a value left as the form
// showed it (masked) keeps its stored value.
func editedMetadata(text string, stored map[string]string) (map[string]string, error) {
	var md map[string]string
	if err := json.Unmarshal([]byte(text), &md); err != nil {
		return nil, badRequest("the metadata is not a JSON object of strings: %v", err)
	}
	if md == nil {
		md = map[string]string{}
	}
	for k, v := range md {
		if old, ok := stored[k]; ok && v == shownValue(k, old) {
			md[k] = old
		}
	}
	return md, nil
}

func (h *Handler) editForm(ctx context.Context, q *req) error {
	id, err := pathID(q)
	if err != nil {
		return err
	}
	row, err := h.loadLetter(ctx, q, id)
	if err != nil {
		return err
	}
	if err := h.editable(row.OriginalTopic); err != nil {
		return err
	}
	lv := newLetterView(row)
	d := editData{Letter: lv, Encoding: "text", Text: lv.Payload.Text, Metadata: metadataText(lv.metadata)}
	if lv.Payload.Kind == "binary" {
		d.Encoding, d.Text = "hex", hex.EncodeToString(row.Payload)
	}
	return h.render(q, "edit.html", &view{Title: fmt.Sprintf("Edit dead letter %d", id), Nav: "dlq", Data: d})
}

// editedPayload decodes the form's payload.
func editedPayload(encoding, text string) ([]byte, error) {
	switch encoding {
	case "text":
		// Browsers send textarea lines with CRLF.
		return []byte(strings.ReplaceAll(text, "\r\n", "\n")), nil
	case "hex":
		b, err := hex.DecodeString(strings.Join(strings.Fields(text), ""))
		if err != nil {
			return nil, badRequest("the payload is not hex: %v", err)
		}
		return b, nil
	}
	return nil, badRequest("payload encoding %q: want text or hex", encoding)
}

func (h *Handler) edit(ctx context.Context, q *req) error {
	id, err := pathID(q)
	if err != nil {
		return err
	}
	payload, err := editedPayload(q.PostForm.Get("encoding"), q.PostForm.Get("payload"))
	if err != nil {
		return err
	}
	row, err := h.loadLetter(ctx, q, id)
	if err != nil {
		return err
	}
	if err := h.editable(row.OriginalTopic); err != nil {
		return err
	}
	lv := newLetterView(row)
	e := &dlq.Edit{Payload: payload}
	mdText := q.PostForm.Get("metadata")
	if strings.TrimSpace(mdText) != "" {
		if e.Metadata, err = editedMetadata(mdText, lv.metadata); err != nil {
			return err
		}
		if maps.Equal(e.Metadata, lv.metadata) {
			e.Metadata = nil
		}
	}
	if q.PostForm.Get("action") == "replay" {
		return h.editReplay(ctx, q, id, e)
	}
	edited := viewPayload(payload)
	d := editData{Letter: lv, Encoding: q.PostForm.Get("encoding"), Text: q.PostForm.Get("payload"), Metadata: mdText, Preview: true,
		Diff: lineDiff(lv.Payload.Text, edited.Text), Changed: string(payload) != string(row.Payload) || e.Metadata != nil}
	if e.Metadata != nil {
		d.MetadataDiff = lineDiff(metadataText(lv.metadata), metadataText(e.Metadata))
	}
	if lv.Payload.Kind == "json" && edited.Kind != "json" {
		d.JSONNote = "The original payload is JSON; the edited one is not."
	}
	return h.render(q, "edit.html", &view{Title: fmt.Sprintf("Preview the edit of dead letter %d", id), Nav: "dlq", Data: d})
}

// resultData is the outcome of a replay or an edit.
type resultData struct {
	Done    []outcome
	Skipped []outcome
}

type outcome struct {
	ID    int64
	Topic string
	Note  string
}

func (h *Handler) editReplay(ctx context.Context, q *req, id int64, e *dlq.Edit) error {
	res := resultData{}
	err := h.takeAndQueue(ctx, q, id, e)
	switch {
	case errors.Is(err, errTaken):
		res.Skipped = append(res.Skipped, outcome{ID: id, Note: "not replayed: another operator replayed or edited it first; nothing was sent"})
	case err != nil:
		return err
	default:
		res.Done = append(res.Done, outcome{ID: id, Note: "the edited copy is queued through the outbox and this dead letter is superseded"})
	}
	return h.render(q, "result.html", &view{Title: "Edit and replay", Nav: "dlq", Data: res})
}

// replayData is the dry run of a replay of a selection.
type replayData struct {
	Letters []letterView
	Skipped []outcome
	IDs     []int64
}

func formIDs(q *req) ([]int64, error) {
	var ids []int64
	for _, s := range q.PostForm["id"] {
		id, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil || id <= 0 {
			return nil, badRequest("dead letter id %q: want a positive number", s)
		}
		ids = append(ids, id)
	}
	if len(ids) == 0 {
		return nil, badRequest("no dead letter selected: tick at least one")
	}
	if len(ids) > listLimit {
		return nil, badRequest("%d dead letters selected: at most %d at a time", len(ids), listLimit)
	}
	return ids, nil
}

// replay is the dry run (action=preview: what would be published where)
// and, confirmed (action=replay), the replay of the selected dead letters.
func (h *Handler) replay(ctx context.Context, q *req) error {
	ids, err := formIDs(q)
	if err != nil {
		return err
	}
	if q.PostForm.Get("action") == "replay" {
		res := resultData{}
		for _, id := range ids {
			err := h.takeAndQueue(ctx, q, id, nil)
			switch {
			case errors.Is(err, errTaken):
				res.Skipped = append(res.Skipped, outcome{ID: id, Note: "already replayed, superseded or resolved (by another operator, or applied through park); not sent again"})
			case err != nil:
				return fmt.Errorf("replaying dead letter %d (the ones before it are queued): %w", id, err)
			default:
				res.Done = append(res.Done, outcome{ID: id, Note: "queued through the outbox to its original topic"})
			}
		}
		return h.render(q, "result.html", &view{Title: "Replay", Nav: "dlq", Data: res})
	}
	d := replayData{}
	err = h.read(ctx, q, func(tx postgres.Tx) error {
		rows, err := dlq.List(ctx, tx, dlq.Filter{IDs: ids})
		for _, r := range rows {
			if r.State != stateDead {
				d.Skipped = append(d.Skipped, outcome{ID: r.ID, Topic: r.OriginalTopic, Note: "is " + r.State + ": it will not be sent"})
				continue
			}
			d.Letters = append(d.Letters, newLetterView(r))
			d.IDs = append(d.IDs, r.ID)
		}
		return err
	})
	if err != nil {
		return err
	}
	return h.render(q, "replay.html", &view{Title: "Replay: dry run", Nav: "dlq", Data: d})
}
