package console

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// sagaStates are the states the list filters by, in lifecycle order.
var sagaStates = []saga.State{saga.StateRunning, saga.StateCompensating, saga.StateStuck, saga.StateCompleted, saga.StateCompensated}

type sagasData struct {
	Type, State string
	States      []saga.State
	Summary     []saga.Summary
	Sagas       []saga.Info
	Limit       int

	// Versions counts the instances per definition version.
	Versions []saga.VersionInfo
}

func (h *Handler) sagas(ctx context.Context, q *req) error {
	d := sagasData{Type: q.FormValue("type"), State: q.FormValue("state"), States: sagaStates, Limit: listLimit}
	if d.State != "" && !isSagaState(d.State) {
		return badRequest("saga state %q: want one of running, compensating, stuck, completed, compensated", d.State)
	}
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		var err error
		if d.Summary, err = saga.Summarize(ctx, tx); err != nil {
			return fmt.Errorf("schema %s: %w", q.schema, err)
		}
		if d.Versions, err = saga.Versions(ctx, tx); err != nil {
			return fmt.Errorf("schema %s: %w", q.schema, err)
		}
		d.Sagas, err = saga.List(ctx, tx, saga.Filter{Type: d.Type, State: saga.State(d.State), Limit: listLimit})
		return err
	})
	if err != nil {
		return err
	}
	return h.render(q, "sagas.html", &view{Title: "Sagas", Nav: "sagas", Data: d})
}

func isSagaState(s string) bool {
	for _, st := range sagaStates {
		if string(st) == s {
			return true
		}
	}
	return false
}

// timelineEntry is one history row with the class the timeline draws it
// with.
type timelineEntry struct {
	saga.HistoryEntry
	Class string
	// Branch: the entry is of a branch of a parallel group (its commands
	// and replies interleave with the other branches').
	Branch bool
	// Took is how long the step's command (or compensation) waited for
	// this reply ("" for entries that are not replies).
	Took string
}

// branchRow is one branch of a parallel group the saga entered.
type branchRow struct {
	Name string
	saga.BranchInfo
}

type sagaData struct {
	Info     saga.Info
	Timeline []timelineEntry
	Mermaid  string
	Stuck    bool
	Result   string
	// Data is the saga's data, secrets masked (saga.Info.RedactedData).
	Data payloadView
	// Branches are the branches of the groups entered, by name.
	Branches []branchRow
	// Waiting is the event a waiting step waits for ("" when the saga
	// is not at a waiting step); Timer is set at a timer step.
	Waiting string
	Timer   bool
	// Diagram is the definition drawn with this instance's path (nil when
	// no step graph is recorded for its version: Mermaid is shown
	// instead); Gantt the timeline drawn to scale.
	Diagram *sagaDiagram
	Gantt   *sagaGantt
}

func timelineClass(kind string) string {
	switch kind {
	case saga.KindCommand, saga.KindReply:
		return "forward"
	case saga.KindCompensation, saga.KindCompensationReply, saga.KindCompensated:
		return "compensation"
	case saga.KindTimeout, saga.KindStuck:
		return "problem"
	case saga.KindLateReply, saga.KindLateSuccess, saga.KindDuplicate:
		return "late"
	case saga.KindCompleted, saga.KindResolved, saga.KindTimerFired, saga.KindMigrated:
		return "done"
	case saga.KindWait, saga.KindTimer:
		return "wait"
	}
	return "other"
}

func (h *Handler) loadSaga(ctx context.Context, q *req, id string) (sagaData, error) {
	var d sagaData
	err := h.read(ctx, q, func(tx postgres.Tx) error {
		in, hist, err := saga.Get(ctx, tx, id)
		if errors.Is(err, saga.ErrNotFound) {
			return notFound("no saga %q in schema %s", id, q.schema)
		}
		if err != nil {
			return err
		}
		d.Info = in
		sent := map[string]time.Time{}
		for _, e := range hist {
			_, branch := in.Branches[e.Step]
			te := timelineEntry{HistoryEntry: e, Class: timelineClass(e.Kind), Branch: branch}
			took(sent, &te)
			d.Timeline = append(d.Timeline, te)
		}
		steps, ok, err := saga.StepGraph(ctx, tx, id)
		if err != nil {
			return err
		}
		if ok {
			d.Diagram = layoutSaga(steps, in, hist)
		}
		d.Gantt = layoutGantt(hist, h.cfg.now())
		for _, name := range slices.Sorted(maps.Keys(in.Branches)) {
			d.Branches = append(d.Branches, branchRow{Name: name, BranchInfo: in.Branches[name]})
		}
		// At a waiting or timer step, the last entry of that step says so.
		if in.State == saga.StateRunning && len(hist) > 0 {
			switch last := hist[len(hist)-1]; {
			case last.Kind == saga.KindWait && last.Step == in.Step:
				d.Waiting = last.Detail
			case last.Kind == saga.KindTimer && last.Step == in.Step:
				d.Timer = true
			}
		}
		return nil
	})
	d.Data = viewPayload(d.Info.RedactedData())
	d.Mermaid = h.cfg.SagaDiagrams[d.Info.Type]
	d.Stuck = d.Info.State == saga.StateStuck
	return d, err
}

func (h *Handler) sagaPage(ctx context.Context, q *req) error {
	id := q.PathValue("id")
	d, err := h.loadSaga(ctx, q, id)
	if err != nil {
		return err
	}
	return h.render(q, "saga.html", &view{Title: "Saga " + id, Nav: "sagas", Data: d})
}

// resolve resolves a stuck saga (retry or skip) with the operator's
// reason, audited in the same transaction.
func (h *Handler) resolve(ctx context.Context, q *req) error {
	id := q.PathValue("id")
	action := saga.ResolveAction(q.PostForm.Get("action"))
	if action != saga.ResolveRetry && action != saga.ResolveSkip {
		return badRequest("resolve action %q: want retry or skip", action)
	}
	reason := strings.TrimSpace(q.PostForm.Get("reason"))
	if reason == "" {
		return badRequest("resolving saga %q needs a reason (it goes into its history and the audit table)", id)
	}
	var res saga.Resolution
	err := h.write(ctx, q, func(tx postgres.Tx) error {
		var err error
		res, err = saga.ResolveTx(ctx, tx, id, action, q.actor+": "+reason, false)
		switch {
		case errors.Is(err, saga.ErrNotFound):
			return notFound("no saga %q in schema %s", id, q.schema)
		case errors.Is(err, saga.ErrNotStuck):
			return &httpError{status: 409, msg: err.Error()}
		case err != nil:
			return err
		}
		return h.audit(ctx, tx, q, "console saga resolve", []string{"--schema=" + q.schema, "--id=" + id, "--action=" + string(action), "--reason=" + reason}, 1)
	})
	if err != nil {
		return err
	}
	d, err := h.loadSaga(ctx, q, id)
	if err != nil {
		return err
	}
	d.Result = res.Description
	return h.render(q, "saga.html", &view{Title: "Saga " + id, Nav: "sagas", Data: d})
}

// took sets te.Took for a reply: the time since its step's command (or
// compensation), which sent records by step and phase.
func took(sent map[string]time.Time, te *timelineEntry) {
	switch te.Kind {
	case saga.KindCommand, saga.KindWait, saga.KindTimer:
		sent["f"+te.Step] = te.At
	case saga.KindCompensation:
		sent["c"+te.Step] = te.At
	case saga.KindReply, saga.KindTimerFired, saga.KindTimeout:
		if at, ok := sent["f"+te.Step]; ok {
			te.Took = fmtTook(te.At.Sub(at))
			delete(sent, "f"+te.Step)
		} else if at, ok := sent["c"+te.Step]; ok && te.Kind == saga.KindTimeout {
			te.Took = fmtTook(te.At.Sub(at))
			delete(sent, "c"+te.Step)
		}
	case saga.KindCompensationReply:
		if at, ok := sent["c"+te.Step]; ok {
			te.Took = fmtTook(te.At.Sub(at))
			delete(sent, "c"+te.Step)
		}
	}
}
