package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// relayView is one relay and the lanes it holds.
type relayView struct {
	outbox.RelayInfo
	// Own are the lanes of its share; Borrowed those lent to it.
	Own, Borrowed string
}

// outboxStats are the outbox's totals.
type outboxStats struct {
	Pending, Failed  int64
	OldestPendingAge time.Duration
}

type outboxData struct {
	Stats    outboxStats
	Topics   []outbox.TopicBacklog
	Relays   []relayView
	Free     string
	Problems []outbox.ProblemEvent
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
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		o, err := outbox.ReadOverview(ctx, tx, listLimit)
		if err != nil {
			return fmt.Errorf("schema %s: %w", q.schema, err)
		}
		d.Stats = outboxStats{Pending: o.Pending, Failed: o.Failed, OldestPendingAge: o.OldestPendingAge}
		d.Topics, d.Problems = o.Topics, o.Problems
		d.Relays, d.Free = relaysOf(o.Relays, o.Lanes)
		for _, p := range d.Problems {
			if p.Failed {
				d.Failed++
			}
		}
		return nil
	})
	return d, err
}

// relaysOf lists the lanes each relay holds (a lease still running), its
// own and those lent to it, and the lanes nobody holds.
func relaysOf(relays []outbox.RelayInfo, lanes []outbox.LaneInfo) ([]relayView, string) {
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
		out = append(out, relayView{RelayInfo: r, Own: strings.Join(own[r.ID], " "), Borrowed: strings.Join(lent[r.ID], " ")})
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
		out = append(out, relayView{RelayInfo: outbox.RelayInfo{ID: o, Load: "?"}, Own: strings.Join(own[o], " "), Borrowed: strings.Join(lent[o], " ")})
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
	var n int64
	err := h.write(ctx, q, func(tx postgres.Tx) error {
		evs, err := outbox.RetryFailedTx(ctx, tx, outbox.FailedFilter{Topic: topic, IDs: ids}, outbox.RetryOptions{})
		if errors.Is(err, outbox.ErrCaptureActive) {
			// Refused, nothing changed: the reason and the fix.
			return &httpError{status: http.StatusConflict, msg: err.Error()}
		}
		if err != nil {
			return err
		}
		n = int64(len(evs))
		args := []string{"--schema=" + q.schema}
		if topic != "" {
			args = append(args, "--topic="+topic)
		}
		for _, id := range ids {
			args = append(args, "--id="+strconv.FormatInt(id, 10))
		}
		return h.audit(ctx, tx, q, "console outbox retry-failed", args, n)
	})
	if err != nil {
		return err
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
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		var err error
		rows, err = audit.List(ctx, tx, listLimit)
		return err
	})
	if err != nil {
		return err
	}
	return h.render(q, "audit.html", &view{Title: "Audit", Nav: "audit", Data: rows})
}
