package saga

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Step kinds of a GraphStep.
const (
	GraphCommand   = "command"
	GraphRetriable = "retriable"
	GraphWait      = "wait"
	GraphTimer     = "timer"
)

// GraphStep is one step of a definition's stored step graph (the text
// each orchestrator records in millwright_saga_definitions.graph), for
// tools that draw a saga without its Go definition, such as the console.
type GraphStep struct {
	Name string
	// Kind is GraphCommand, GraphRetriable, GraphWait or GraphTimer.
	Kind string
	// WaitFor is the event a GraphWait step waits for.
	WaitFor string
	// Group is the parallel group the step is a branch of ("" for none).
	// A group's branches are consecutive steps.
	Group string
	// Compensation: the step has a compensation.
	Compensation bool
	// The step's reply types.
	SuccessReply, FailureReply string
}

// ParseStepGraph parses a step graph's text (one "step NAME" line per
// step with tab-separated key=value fields, values quoted). Unknown
// fields are ignored, so that a graph written by a newer version parses.
func ParseStepGraph(text string) ([]GraphStep, error) {
	steps, _ := parseGraph(text)
	out := make([]GraphStep, 0, len(steps))
	for i, s := range steps {
		g := GraphStep{Name: s.name, Kind: GraphCommand}
		for _, f := range s.fields {
			k, v, ok := strings.Cut(f, "=")
			if !ok {
				return nil, fmt.Errorf("saga: step graph line %d (step %q): field %q is not key=value", i+1, s.name, f)
			}
			if uq, err := strconv.Unquote(v); err == nil {
				v = uq
			}
			switch k {
			case "success":
				g.SuccessReply = v
			case "failure":
				g.FailureReply = v
			case "compensation":
				g.Compensation = v == "yes"
			case "group":
				g.Group = v
			case "kind":
				if ev, ok := strings.CutPrefix(v, "wait "); ok {
					g.Kind, g.WaitFor = GraphWait, ev
				} else {
					g.Kind = v
				}
			}
		}
		out = append(out, g)
	}
	return out, nil
}

// StepGraph returns the step graph of the definition version saga id
// runs on, as its orchestrator recorded it. ok is false when none is
// recorded: the version's orchestrator has not run since versions were
// introduced (then draw from Definition.Mermaid), or there is no such
// saga.
func StepGraph(ctx context.Context, db postgres.Handle, id string) (steps []GraphStep, ok bool, err error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, false, fmt.Errorf("saga %q: %w", id, err)
	}
	text, ok, err := storage.SagaInstanceGraph(ctx, q, id)
	if err != nil {
		return nil, false, fmt.Errorf("saga %q: reading its step graph from millwright_saga_definitions%s: %w", id, storage.Hint(err), err)
	}
	if !ok {
		return nil, false, nil
	}
	steps, err = ParseStepGraph(text)
	if err != nil {
		return nil, false, fmt.Errorf("saga %q: %w", id, err)
	}
	return steps, true, nil
}
