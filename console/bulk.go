package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
)

// Bulk actions over the dead letters page's filter: a dry run (the count
// and a sample), a cap the operator confirms, then a job that runs in the
// background in bounded batches, each its own transaction
// (dlq.BulkBatchTx), and shows its progress; an interrupted job (the
// process stopped) is resumed from its page and continues after its
// cursor. One audit row per action, with the filter and the count.

// bulkSample is how many dead letters a bulk dry run shows.
const bulkSample = 10

// bulkBatch is how many dead letters each transaction of a bulk job
// handles.
const bulkBatch = 200

func (h *Handler) bulkRoutes() {
	h.page("POST /dead-letters/bulk/replay", func(ctx context.Context, q *req) error { return h.bulk(ctx, q, dlq.BulkReplay) })
	h.page("POST /dead-letters/bulk/discard", func(ctx context.Context, q *req) error { return h.bulk(ctx, q, dlq.BulkDiscard) })
	h.page("GET /bulk/{id}", h.bulkPage)
	h.page("POST /bulk/{id}/resume", h.bulkResume)
}

// bulkData is the dry run of a bulk action, or a job's progress.
type bulkData struct {
	Action                  dlq.BulkAction
	Topic, ErrorType, Query string
	Plan                    dlq.BulkPlan
	Job                     dlq.BulkJob
	Running                 bool
}

func formFilter(q *req) dlq.Filter {
	return dlq.Filter{Topic: q.PostForm.Get("topic"), ErrorType: q.PostForm.Get("error_type"), ErrorContains: q.PostForm.Get("q")}
}

func bulkNeed(a dlq.BulkAction) Role {
	if a == dlq.BulkReplay {
		return RoleOperator
	}
	return RoleAdmin
}

// bulk is the dry run (step=preview) and, confirmed with a cap
// (step=confirm), the start of a bulk action over the filter.
func (h *Handler) bulk(ctx context.Context, q *req, action dlq.BulkAction) error {
	f := formFilter(q)
	d := bulkData{Action: action, Topic: f.Topic, ErrorType: f.ErrorType, Query: f.ErrorContains}
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		var err error
		d.Plan, err = dlq.PlanBulk(ctx, tx, f, bulkSample)
		return err
	})
	if err != nil {
		return err
	}
	if q.PostForm.Get("step") != "confirm" {
		return h.render(q, "bulk.html", &view{Title: fmt.Sprintf("Bulk %s: dry run", action), Nav: "dlq", Data: d})
	}
	limit, err := strconv.Atoi(strings.TrimSpace(q.PostForm.Get("cap")))
	if err != nil || limit < 1 {
		return badRequest("cap %q: confirm the number of dead letters the action may touch (the dry run counted %d)", q.PostForm.Get("cap"), d.Plan.Count)
	}
	var id int64
	err = h.write(ctx, q, func(tx postgres.Tx) error {
		var err error
		id, err = dlq.StartBulkTx(ctx, tx, action, f, d.Plan, limit, h.operator(q))
		return err
	})
	switch {
	case errors.Is(err, dlq.ErrOverCap):
		return &httpError{status: http.StatusConflict, msg: err.Error()}
	case err != nil:
		return err
	}
	h.runBulk(q, id)
	http.Redirect(q.w, q.Request, fmt.Sprintf("%s/bulk/%d?schema=%s", h.cfg.BasePath, id, q.schema), http.StatusSeeOther)
	return nil
}

// runBulk runs job id in the background, batch after batch in the
// request's schema, until it is done or fails (the job records its
// error); a process that stops interrupts it, and its page resumes it.
func (h *Handler) runBulk(q *req, id int64) {
	schema, opts := q.schema, dlq.BulkRunOptions{By: h.operator(q), Batch: bulkBatch}
	go func() {
		ctx := context.Background()
		for {
			var (
				more bool
				err  error
			)
			err = migrate.InSchema(ctx, h.db, schema, false, func(tx postgres.Tx) error {
				_, more, err = dlq.BulkBatchTx(ctx, tx, id, opts)
				return err
			})
			if err != nil {
				cause := err
				ferr := migrate.InSchema(ctx, h.db, schema, false, func(tx postgres.Tx) error { return dlq.MarkBulkFailedTx(ctx, tx, id, cause) })
				h.cfg.Logger.Error("console: bulk action failed", errors.Join(cause, ferr), nil)
				return
			}
			if !more {
				return
			}
		}
	}()
}

func bulkID(q *req) (int64, error) {
	id, err := strconv.ParseInt(q.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		return 0, badRequest("bulk action id %q: want a positive number", q.PathValue("id"))
	}
	return id, nil
}

func (h *Handler) loadBulk(ctx context.Context, q *req, id int64) (dlq.BulkJob, error) {
	var job dlq.BulkJob
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		var err error
		job, err = dlq.GetBulkJob(ctx, tx, id)
		return err
	})
	if errors.Is(err, dlq.ErrBulkNotFound) {
		return job, notFound("no bulk action %d in schema %s", id, q.schema)
	}
	return job, err
}

// bulkPage shows a job's progress (refreshing itself while it runs).
func (h *Handler) bulkPage(ctx context.Context, q *req) error {
	id, err := bulkID(q)
	if err != nil {
		return err
	}
	job, err := h.loadBulk(ctx, q, id)
	if err != nil {
		return err
	}
	d := bulkData{Action: job.Action, Job: job, Running: job.State == "running"}
	return h.render(q, "bulk.html", &view{Title: fmt.Sprintf("Bulk %s %d", job.Action, id), Nav: "dlq", Data: d})
}

// bulkResume runs an interrupted or failed job again, after its cursor;
// it needs the role of the job's action.
func (h *Handler) bulkResume(ctx context.Context, q *req) error {
	id, err := bulkID(q)
	if err != nil {
		return err
	}
	job, err := h.loadBulk(ctx, q, id)
	if err != nil {
		return err
	}
	if need := bulkNeed(job.Action); !q.role.Allows(need) {
		return &httpError{status: http.StatusForbidden, msg: fmt.Sprintf("refused: resuming a bulk %s needs the %s role; %s is %s", job.Action, need, q.actor, article(q.role))}
	}
	if !job.Finished() {
		h.runBulk(q, id)
	}
	http.Redirect(q.w, q.Request, fmt.Sprintf("%s/bulk/%d?schema=%s", h.cfg.BasePath, id, q.schema), http.StatusSeeOther)
	return nil
}
