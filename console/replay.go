package console

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/audit"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
)

// errTaken is takeAndQueue's error for a dead letter that is no longer
// dead: replayed or superseded by someone else, or resolved through park,
// before or concurrently.
var errTaken = errors.New("the dead letter was already replayed, superseded or resolved")

// takeAndQueue replays dead letter id through the outbox: in one
// transaction (in the request's schema) it moves the row out of the dead
// state (to replayed; to superseded when edited is not nil), queues the
// message (the original, or with the edited payload) with outbox.Add, and
// records the action and its operator in the audit table. The move is a
// conditional update (WHERE state = 'dead', one row expected): of two
// operators clicking at once, or an edit racing a plain replay (here or
// `millwright dlq replay`, whose row lock it waits for), one commits and
// the other gets errTaken with nothing queued, so exactly one message is
// ever sent for the row.
//
// The message keeps the original's event id, metadata and topic, plus
// metadata.DeadLetterReplayOf = the row id, and
// metadata.DeadLetterReplayFor = the consumer that gave up on it
// (dlq.SetReplayFor): the one that failed processes it once, and the
// other consumer groups on the topic ack it without running their handler
// (whether or not they still hold an idempotency mark for it). A dead
// letter that records no consumer goes to every group on the topic.
func (h *Handler) takeAndQueue(ctx context.Context, q *req, id int64, edited *edit) error {
	tx, err := h.begin(ctx, q, false)
	if err != nil {
		return err
	}
	defer rollback(ctx, tx)
	row, err := storage.GetDeadLetter(ctx, tx, id)
	if storage.IsNoRows(err) {
		return notFound("no dead letter %d in schema %s", id, q.schema)
	}
	if err != nil {
		return fmt.Errorf("reading dead letter %d: %w", id, err)
	}
	if row.State != stateDead {
		return errTaken
	}
	ev, err := replayEvent(row, edited)
	if err != nil {
		return err
	}
	state, command := stateReplayed, "console dlq replay"
	by := ""
	if edited != nil {
		state, command, by = stateSuperseded, "console dlq edit-replay", ev.ID
	}
	if err := storage.TakeDeadLetter(ctx, tx, id, state, by, q.actor); err != nil {
		if errors.Is(err, storage.ErrConflict) {
			return errTaken
		}
		return fmt.Errorf("marking dead letter %d %s: %w", id, state, err)
	}
	if err := outbox.Add(ctx, storage.AsTx(tx), ev); err != nil {
		return fmt.Errorf("queueing dead letter %d through the outbox (nothing was changed): %w", id, err)
	}
	args := []string{"--schema=" + q.schema, "--id=" + strconv.FormatInt(id, 10)}
	if edited != nil {
		args = append(args, fmt.Sprintf("--payload-bytes=%d", len(edited.payload)))
		if edited.metadata != nil {
			args = append(args, "--metadata-edited")
		}
	}
	if err := h.audit(ctx, tx, q, command, args, 1); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("committing the replay of dead letter %d (nothing was sent if this failed): %w", id, err)
	}
	return nil
}

// edit is an operator's edit of a dead letter: its payload, and its
// metadata when that was edited too (nil: the stored metadata).
type edit struct {
	payload  []byte
	metadata map[string]string
}

// replayEvent is the outbox event replaying row, with the edit when edited
// is not nil.
func replayEvent(row storage.DeadLetterRow, edited *edit) (outbox.Event, error) {
	md, err := row.MetadataMap()
	if err != nil {
		return outbox.Event{}, err
	}
	// The stored metadata first: the edit form showed it as text, so an
	// edit of a binary one would send its text, not its bytes.
	if err := outboxCarries(row.ID, "", md); err != nil {
		return outbox.Event{}, err
	}
	if edited != nil && edited.metadata != nil {
		md = maps.Clone(edited.metadata)
	}
	if row.OriginalTopic == "" {
		return outbox.Event{}, badRequest("dead letter %d has no original topic recorded: replay it with `millwright dlq replay --target`", row.ID)
	}
	if md == nil {
		md = map[string]string{}
	}
	md[metadata.DeadLetterReplayOf] = strconv.FormatInt(row.ID, 10)
	dlq.SetReplayFor(md, row.ConsumerGroup, row.Handler) // the other consumer groups on the topic ack it unrun
	id := md[metadata.EventID]
	if id == "" {
		id = row.MessageUUIDRaw
	}
	if err := outboxCarries(row.ID, id, md); err != nil {
		return outbox.Event{}, err
	}
	payload := row.Payload
	if edited != nil {
		payload = edited.payload
	}
	return outbox.Event{
		Topic: row.OriginalTopic, ID: id, Payload: payload, RawPayload: true, Metadata: md,
		AggregateType: md[metadata.AggregateType], AggregateID: md[metadata.AggregateID],
		EventType: md[metadata.EventType], Source: md[metadata.EventSource],
	}, nil
}

// outboxCarries refuses a replay the outbox cannot carry as it is: its
// metadata and event id are text (JSONB, text columns), and a binary
// Kafka key or header (bytes that are not UTF-8, or NUL) would reach the
// consumer changed. `millwright dlq replay` publishes the bytes.
func outboxCarries(rowID int64, id string, md map[string]string) error {
	fix := fmt.Sprintf("the console replays through the outbox, whose metadata is text; replay it byte for byte with `millwright dlq replay --id %d`", rowID)
	if storage.CheckText(id) != nil {
		return badRequest("dead letter %d: its message UUID %q is not UTF-8 text: %s", rowID, id, fix)
	}
	for _, k := range slices.Sorted(maps.Keys(md)) {
		if storage.CheckText(k) != nil || storage.CheckText(md[k]) != nil {
			return badRequest("dead letter %d: metadata %q is not UTF-8 text (a binary key or header): %s", rowID, k, fix)
		}
	}
	return nil
}

// audit records a console action in tx: who (the authenticated operator),
// what, and how many rows. A schema without the audit table refuses the
// action: nothing the console changes goes unrecorded.
func (h *Handler) audit(ctx context.Context, tx storage.Tx, q *req, command string, args []string, affected int64) error {
	_, err := audit.Record(ctx, tx, audit.Entry{User: q.actor, Host: "console", Command: command,
		Args: audit.RedactArgs(args), Confirmed: "console", Affected: affected})
	if errors.Is(err, audit.ErrNotMigrated) {
		return fmt.Errorf("refused: schema %s has no millwright_audit table, and every console action is audited: run `millwright migrate`", q.schema)
	}
	return err
}
