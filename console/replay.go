package console

import (
	"context"
	"errors"
	"fmt"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/postgres"
)

// errTaken is takeAndQueue's error for a dead letter that is no longer
// dead: replayed or superseded by someone else, or resolved through park,
// before or concurrently.
var errTaken = errors.New("the dead letter was already replayed, superseded or resolved")

// takeAndQueue replays dead letter id with dlq.ReplayTx, the replay
// `millwright dlq replay` runs too, in one transaction in the request's
// schema: the row leaves the dead state (replayed; superseded when edited
// is not nil), its message (or the edited copy) is queued through the
// outbox, and the audit row names the operator. Of two operators clicking
// at once, or an edit racing a plain replay (here or in the CLI), one
// commits and the other gets errTaken with nothing queued, so exactly one
// message is ever sent for the row.
func (h *Handler) takeAndQueue(ctx context.Context, q *req, id int64, edited *dlq.Edit) error {
	err := h.write(ctx, q, func(tx postgres.Tx) error {
		_, err := dlq.ReplayTx(ctx, tx, id, dlq.ReplayOneOptions{By: h.operator(q), Edit: edited})
		return err
	})
	switch {
	case errors.Is(err, dlq.ErrNotDead):
		return errTaken
	case errors.Is(err, dlq.ErrNotFound):
		return notFound("no dead letter %d in schema %s", id, q.schema)
	case errors.Is(err, dlq.ErrNotReplayable):
		return badRequest("%v", err)
	case errors.Is(err, audit.ErrNotMigrated):
		return notMigrated(q)
	case err != nil:
		return fmt.Errorf("replaying dead letter %d (nothing was sent): %w", id, err)
	}
	return nil
}

// operator is the request's operator, for the audit rows of its actions.
func (h *Handler) operator(q *req) audit.Operator {
	return audit.Operator{User: q.actor, Host: "console", Confirmed: "console"}
}

func notMigrated(q *req) error {
	return fmt.Errorf("refused: schema %s has no millwright_audit table, and every console action is audited: run `millwright migrate`", q.schema)
}

// audit records a console action in tx: who (the authenticated operator),
// what, and how many rows. A schema without the audit table refuses the
// action: nothing the console changes goes unrecorded.
func (h *Handler) audit(ctx context.Context, tx postgres.Tx, q *req, command string, args []string, affected int64) error {
	_, err := audit.RecordTx(ctx, tx, h.operator(q).Entry(command, args, affected))
	if errors.Is(err, audit.ErrNotMigrated) {
		return notMigrated(q)
	}
	return err
}
