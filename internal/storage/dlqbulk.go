package storage

import (
	"context"
	"database/sql"
	"strconv"
	"time"
)

// DLQ bulk actions: millwright_dlq_bulk (dlq migration 007).

// BulkRow is one row of millwright_dlq_bulk.
type BulkRow struct {
	ID                   int64
	Action               string
	Filter               []byte // JSON
	MaxID                int64
	Cap, Planned         int
	Cursor               int64
	Done, Skipped        int
	State                string
	CreatedBy            string
	CreatedAt, UpdatedAt time.Time
	Error                string
}

const bulkColumns = `id, action, filter::text, max_id, cap, planned, cursor_id, done, skipped, state, created_by, created_at, updated_at, error`

func scanBulk(r Row) (BulkRow, error) {
	var b BulkRow
	var filter string
	err := r.Scan(&b.ID, &b.Action, &filter, &b.MaxID, &b.Cap, &b.Planned, &b.Cursor, &b.Done, &b.Skipped, &b.State,
		&b.CreatedBy, &b.CreatedAt, &b.UpdatedAt, &b.Error)
	b.Filter = []byte(filter)
	return b, err
}

// InsertBulk writes a new running job and returns its id.
func InsertBulk(ctx context.Context, q Querier, b BulkRow) (int64, error) {
	var id int64
	err := q.QueryRow(ctx, Statement{SQL: `INSERT INTO millwright_dlq_bulk (action, filter, max_id, cap, planned, created_by)
VALUES ($1, $2::jsonb, $3, $4, $5, $6) RETURNING id`, Args: []any{b.Action, string(b.Filter), b.MaxID, b.Cap, b.Planned, b.CreatedBy},
		Expect: NoExpect, What: "recording a bulk action"}, &id)
	return id, err
}

// LockBulk reads job id FOR UPDATE: the runners of one job take turns,
// batch by batch. sql.ErrNoRows when there is none.
func LockBulk(ctx context.Context, q Querier, id int64) (BulkRow, error) {
	return getBulk(ctx, q, `SELECT `+bulkColumns+` FROM millwright_dlq_bulk WHERE id = $1 FOR UPDATE`, id)
}

// GetBulk reads job id. sql.ErrNoRows when there is none.
func GetBulk(ctx context.Context, q Querier, id int64) (BulkRow, error) {
	return getBulk(ctx, q, `SELECT `+bulkColumns+` FROM millwright_dlq_bulk WHERE id = $1`, id)
}

func getBulk(ctx context.Context, q Querier, query string, id int64) (BulkRow, error) {
	var b BulkRow
	found := false
	err := q.Query(ctx, Statement{SQL: query, Args: []any{id}, Expect: NoExpect, What: "reading a bulk action"}, func(r Row) error {
		found = true
		var err error
		b, err = scanBulk(r)
		return err
	})
	if err == nil && !found {
		err = sql.ErrNoRows
	}
	return b, err
}

// AdvanceBulk records a batch: the cursor, the counts and the state.
func AdvanceBulk(ctx context.Context, q Querier, b BulkRow) error {
	_, err := q.Exec(ctx, Statement{SQL: `UPDATE millwright_dlq_bulk SET cursor_id = $2, done = $3, skipped = $4, state = $5, error = $6, updated_at = now()
WHERE id = $1`, Args: []any{b.ID, b.Cursor, b.Done, b.Skipped, b.State, b.Error}, Expect: 1, What: "advancing a bulk action"})
	return err
}

// ListBulk returns the newest limit jobs, newest first.
func ListBulk(ctx context.Context, q Querier, limit int) ([]BulkRow, error) {
	var out []BulkRow
	err := q.Query(ctx, Statement{SQL: `SELECT ` + bulkColumns + ` FROM millwright_dlq_bulk ORDER BY id DESC LIMIT ` + strconv.Itoa(max(limit, 1)),
		Expect: NoExpect, What: "listing bulk actions"}, func(r Row) error {
		b, err := scanBulk(r)
		out = append(out, b)
		return err
	})
	return out, err
}

// DiscardDeadLetter moves row id from dead to discarded, recording by.
// discarded is false when the row is not dead.
func DiscardDeadLetter(ctx context.Context, q Querier, id int64, by string) (discarded bool, err error) {
	n, err := q.Exec(ctx, Statement{SQL: `UPDATE millwright_dead_letters SET state = 'discarded', resolved_at = now(), resolved_by = $2
WHERE id = $1 AND state = 'dead'`, Args: []any{id, by}, Expect: NoExpect, What: "discarding a dead letter"})
	return n == 1, err
}

// CountDeadLettersUpTo counts the rows f selects and returns the largest
// id among them (0 for none): a bulk action's dry run, whose id bound
// keeps rows recorded later out of the action.
func CountDeadLettersUpTo(ctx context.Context, q Querier, f DeadLetterFilter) (n int, maxID int64, err error) {
	where, args := f.where()
	err = q.QueryRow(ctx, Statement{SQL: "SELECT count(*), COALESCE(max(id), 0) FROM millwright_dead_letters" + where, Args: args,
		Expect: NoExpect, What: "counting dead letters"}, &n, &maxID)
	return n, maxID, err
}
