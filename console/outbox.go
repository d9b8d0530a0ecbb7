package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/millwright/millwright/internal/audit"
	"github.com/millwright/millwright/internal/storage"
)

// relayView is one relay and the lanes it holds.
type relayView struct {
	storage.OutboxRelayRow
	// Own are the lanes of its share; Borrowed those lent to it.
	Own, Borrowed string
}

type outboxData struct {
	Stats    storage.OutboxStats
	Topics   []storage.OutboxTopicBacklog
	Relays   []relayView
	Free     string
	Problems []storage.OutboxProblem
	Failed   int
	Retried  int64
	Notice   string
}

func (h *Handler) outbox(ctx context.Context, q *req) error {
	d, err := h.loadOutbox(ctx, q)
	if err != nil {
		return err
	}
	return h.render(q, "outbox.html", &view{Title: "Outbox", Nav: "outbox", Data: d})
}

func (h *Handler) loadOutbox(ctx context.Context, q *req) (outboxData, error) {
	var d outboxData
	err := h.read(ctx, q, func(tx storage.Tx) error {
		var err error
		if d.Stats, err = storage.ReadOutboxStats(ctx, tx); err != nil {
			return fmt.Errorf("reading the outbox of schema %s%s: %w", q.schema, storage.Hint(err), err)
		}
		if d.Topics, err = storage.ReadOutboxBacklog(ctx, tx); err != nil {
			return err
		}
		relays, err := storage.ReadOutboxRelays(ctx, tx)
		if err != nil {
			return err
		}
		lanes, err := storage.ReadOutboxLanes(ctx, tx)
		if err != nil {
			return err
		}
		d.Relays, d.Free = relaysOf(relays, lanes)
		d.Problems, err = storage.ReadOutboxProblems(ctx, tx, listLimit, 2000)
		for _, p := range d.Problems {
			if p.Failed {
				d.Failed++
			}
		}
		return err
	})
	return d, err
}

// relaysOf lists the lanes each relay holds (a lease still running), its
// own and those lent to it, and the lanes nobody holds.
func relaysOf(relays []storage.OutboxRelayRow, lanes []storage.OutboxLane) ([]relayView, string) {
	own, lent := map[string][]string{}, map[string][]string{}
	var free []string
	for _, l := range lanes {
		n := strconv.Itoa(l.Lane)
		switch {
		case !l.Held || l.Owner == "":
			free = append(free, n)
		case l.Lent:
			lent[l.Owner] = append(lent[l.Owner], n)
		default:
			own[l.Owner] = append(own[l.Owner], n)
		}
	}
	out := make([]relayView, 0, len(relays))
	seen := map[string]bool{}
	for _, r := range relays {
		seen[r.ID] = true
		out = append(out, relayView{OutboxRelayRow: r, Own: strings.Join(own[r.ID], " "), Borrowed: strings.Join(lent[r.ID], " ")})
	}
	// A lane held by a relay that no longer announces itself still shows.
	var ghosts []string
	for o := range own {
		if !seen[o] {
			ghosts = append(ghosts, o)
		}
	}
	for o := range lent {
		if !seen[o] && !slices.Contains(ghosts, o) {
			ghosts = append(ghosts, o)
		}
	}
	slices.Sort(ghosts)
	for _, o := range ghosts {
		out = append(out, relayView{OutboxRelayRow: storage.OutboxRelayRow{ID: o, Load: "?"}, Own: strings.Join(own[o], " "), Borrowed: strings.Join(lent[o], " ")})
	}
	return out, strings.Join(free, " ")
}

// retryFailed puts failed rows (the ticked ones, or all of a topic) back
// to pending with a fresh budget, wakes the relays, and audits it, in one
// transaction.
func (h *Handler) retryFailed(ctx context.Context, q *req) error {
	var ids []int64
	for _, s := range q.PostForm["id"] {
		id, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil || id <= 0 {
			return badRequest("outbox row id %q: want a positive number", s)
		}
		ids = append(ids, id)
	}
	topic := q.PostForm.Get("topic")
	if len(ids) == 0 && topic == "" && q.PostForm.Get("all") != "1" {
		return badRequest("nothing selected: tick failed rows, or retry a whole topic")
	}
	tx, err := h.begin(ctx, q, false)
	if err != nil {
		return err
	}
	defer rollback(ctx, tx)
	rows, err := storage.ListFailedEvents(ctx, tx, topic, ids, true)
	if err != nil {
		return fmt.Errorf("listing failed outbox rows: %w", err)
	}
	sel := make([]int64, len(rows))
	for i, r := range rows {
		sel[i] = r.ID
	}
	var n int64
	if len(sel) > 0 {
		if n, err = storage.ResetFailedEvents(ctx, tx, sel); err != nil {
			if errors.Is(err, storage.ErrCaptureActive) {
				// Refused, nothing changed: the reason and the fix.
				return &httpError{status: http.StatusConflict, msg: err.Error()}
			}
			return fmt.Errorf("resetting %d failed outbox row(s): %w", len(sel), err)
		}
		if err := storage.NotifyOutboxRelays(ctx, tx); err != nil {
			return fmt.Errorf("waking the relays: %w", err)
		}
	}
	args := []string{"--schema=" + q.schema}
	if topic != "" {
		args = append(args, "--topic="+topic)
	}
	for _, id := range ids {
		args = append(args, "--id="+strconv.FormatInt(id, 10))
	}
	if err := h.audit(ctx, tx, q, "console outbox retry-failed", args, n); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("committing retry-failed: %w", err)
	}
	d, err := h.loadOutbox(ctx, q)
	if err != nil {
		return err
	}
	d.Retried = n
	d.Notice = fmt.Sprintf("%d failed row(s) put back to pending with a fresh retry budget", n)
	return h.render(q, "outbox.html", &view{Title: "Outbox", Nav: "outbox", Data: d})
}

func (h *Handler) auditPage(ctx context.Context, q *req) error {
	var rows []audit.Entry
	err := h.read(ctx, q, func(tx storage.Tx) error {
		var err error
		rows, err = audit.List(ctx, tx, listLimit)
		return err
	})
	if err != nil {
		return err
	}
	return h.render(q, "audit.html", &view{Title: "Audit", Nav: "audit", Data: rows})
}
