package console

import (
	"fmt"
	"strings"
	"time"

	"github.com/millwright/millwright/saga"
)

// The saga page's pictures, laid out here and drawn by the saga.html
// template as inline SVG: no script runs and nothing is fetched, so they
// work under the console's Content-Security-Policy and offline. The
// console has no user code: the diagram is drawn from the step graph the
// orchestrator recorded for the instance's definition version
// (saga.StepGraph) and the instance's history.

// Diagram geometry, in SVG user units.
const (
	dgBoxW    = 170
	dgBoxH    = 44
	dgGapX    = 24
	dgRowH    = 78
	dgMargin  = 16
	dgCompGap = 70
	dgLabelN  = 24 // runes of a step name shown in its box
)

// dgBox is a step (or an end state) of the diagram.
type dgBox struct {
	X, Y, W, H int
	// Step is the step's name ("" for an end state); Label what the box
	// says, Sub its second line (the kind, the event waited for, how long
	// the step took).
	Step, Label, Sub string
	// Class marks the box: "step" or "undo" or "end", its kind
	// ("kind-wait", "kind-timer", "kind-retriable"), and this instance's
	// path ("taken", "sent", "failed", "timed-out", "current",
	// "comp-sent", "comp-done", "comp-failed", "stuck").
	Class string
	// Rx rounds the corners: waits and timers are drawn as pills.
	Rx int
}

// dgEdge is an arrow from one box to another.
type dgEdge struct {
	X1, Y1, X2, Y2 int
	// Class: "fwd" or "comp", plus "taken" when this instance went along
	// it.
	Class string
}

// dgGroup is the frame around a parallel group's branches.
type dgGroup struct {
	X, Y, W, H int
	Name       string
}

// sagaDiagram is the laid-out diagram of one instance.
type sagaDiagram struct {
	W, H   int
	Boxes  []dgBox
	Edges  []dgEdge
	Groups []dgGroup
}

// stepMarks is what the history says happened to one step.
type stepMarks struct {
	commanded, replied, failed, timedOut  bool
	compSent, compDone, compFailed, stuck bool
	took                                  time.Duration
	commandAt                             time.Time
}

// markSteps reads the history: per step, what happened to it, and how
// long its last command took to be answered.
func markSteps(hist []saga.HistoryEntry) map[string]*stepMarks {
	m := map[string]*stepMarks{}
	get := func(s string) *stepMarks {
		if m[s] == nil {
			m[s] = &stepMarks{}
		}
		return m[s]
	}
	for _, e := range hist {
		if e.Step == "" {
			continue
		}
		s := get(e.Step)
		switch e.Kind {
		case saga.KindCommand, saga.KindWait, saga.KindTimer:
			s.commanded, s.commandAt = true, e.At
			if e.Error != "" {
				s.failed = true
			}
		case saga.KindReply, saga.KindTimerFired:
			if e.Error != "" {
				s.failed = true
			} else {
				s.replied = true
			}
			if !s.commandAt.IsZero() {
				s.took = e.At.Sub(s.commandAt)
			}
		case saga.KindTimeout:
			if s.compSent {
				s.compFailed = true
			} else {
				s.timedOut = true
			}
		case saga.KindLateSuccess:
			s.replied = true
		case saga.KindCompensation:
			s.compSent = true
			if e.Error != "" {
				s.compFailed = true
			}
		case saga.KindCompensationReply:
			if e.Error != "" {
				s.compFailed = true
			} else {
				s.compDone = true
			}
		case saga.KindStuck:
			s.stuck = true
		}
	}
	return m
}

// layoutSaga lays out the step graph steps with the path of instance in
// (its history hist).
func layoutSaga(steps []saga.GraphStep, in saga.Info, hist []saga.HistoryEntry) *sagaDiagram {
	marks := markSteps(hist)
	// Rows: a single step, or the consecutive branches of one group.
	var rows [][]saga.GraphStep
	for i, s := range steps {
		if s.Group != "" && i > 0 && steps[i-1].Group == s.Group {
			rows[len(rows)-1] = append(rows[len(rows)-1], s)
			continue
		}
		rows = append(rows, []saga.GraphStep{s})
	}
	widest := 1
	for _, r := range rows {
		widest = max(widest, len(r))
	}
	fwdW := widest*dgBoxW + (widest-1)*dgGapX
	compX := dgMargin + fwdW + dgCompGap
	d := &sagaDiagram{}
	// Start row at the top, then the steps, then Completed.
	top := dgMargin + 64
	rowY := func(r int) int { return top + r*dgRowH }
	rowX := func(n, j int) int {
		w := n*dgBoxW + (n-1)*dgGapX
		return dgMargin + (fwdW-w)/2 + j*(dgBoxW+dgGapX)
	}
	current := in.State == saga.StateRunning || in.State == saga.StateCompensating || in.State == saga.StateStuck
	type pos struct{ x, y int }
	boxAt := map[string]pos{}
	undoAt := map[string]pos{}
	var prev []pos // bottom centres of the previous row
	var undoChain []string
	for r, row := range rows {
		y := rowY(r)
		var cur []pos
		if g := row[0].Group; g != "" {
			x0 := rowX(len(row), 0)
			w := len(row)*dgBoxW + (len(row)-1)*dgGapX
			d.Groups = append(d.Groups, dgGroup{X: x0 - 8, Y: y - 16, W: w + 16, H: dgBoxH + 24, Name: g})
		}
		for j, s := range row {
			x := rowX(len(row), j)
			mk := marks[s.Name]
			if mk == nil {
				mk = &stepMarks{}
			}
			cls := []string{"step", "kind-" + s.Kind}
			sub := s.Kind
			rx := 3
			switch s.Kind {
			case saga.GraphWait:
				sub, rx = "waits for "+s.WaitFor, dgBoxH/2
			case saga.GraphTimer:
				rx = dgBoxH / 2
			}
			switch {
			case mk.failed:
				cls = append(cls, "failed")
			case mk.timedOut:
				cls = append(cls, "timed-out")
			case mk.replied:
				cls = append(cls, "taken")
			case mk.commanded:
				cls = append(cls, "sent")
			}
			if mk.took > 0 {
				sub += " · " + fmtTook(mk.took)
			}
			if current && in.State == saga.StateRunning && s.Name == in.Step {
				cls = append(cls, "current")
			}
			d.Boxes = append(d.Boxes, dgBox{X: x, Y: y, W: dgBoxW, H: dgBoxH, Step: s.Name, Label: shorten(dgLabelN, s.Name), Sub: sub, Class: strings.Join(cls, " "), Rx: rx})
			boxAt[s.Name] = pos{x, y}
			cur = append(cur, pos{x + dgBoxW/2, y})
			for _, p := range prev {
				d.Edges = append(d.Edges, dgEdge{X1: p.x, Y1: p.y, X2: x + dgBoxW/2, Y2: y, Class: edgeClass("fwd", mk.commanded)})
			}
			if s.Compensation {
				undoChain = append(undoChain, s.Name)
			}
		}
		prev = prev[:0]
		for _, c := range cur {
			prev = append(prev, pos{c.x, c.y + dgBoxH})
		}
	}
	endY := rowY(len(rows))
	done := in.State == saga.StateCompleted
	endCls := "end end-completed"
	if done {
		endCls += " taken current"
	}
	endX := dgMargin + (fwdW-dgBoxW)/2
	d.Boxes = append(d.Boxes, dgBox{X: endX, Y: endY, W: dgBoxW, H: dgBoxH, Label: "Completed", Class: endCls, Rx: dgBoxH / 2})
	for _, p := range prev {
		d.Edges = append(d.Edges, dgEdge{X1: p.x, Y1: p.y, X2: endX + dgBoxW/2, Y2: endY, Class: edgeClass("fwd", done)})
	}
	// The compensations, in a column to the right, each beside its step;
	// they run bottom up, ending at Compensated at the top.
	for i, name := range undoChain {
		p := boxAt[name]
		mk := marks[name]
		if mk == nil {
			mk = &stepMarks{}
		}
		// Branches of one row share the row: offset them down a little.
		y := p.y
		for _, other := range undoChain[:i] {
			if boxAt[other].y == p.y {
				y += 12
			}
		}
		x := compX
		cls := []string{"undo"}
		switch {
		case mk.stuck:
			cls = append(cls, "stuck")
		case mk.compFailed:
			cls = append(cls, "comp-failed")
		case mk.compDone:
			cls = append(cls, "comp-done")
		case mk.compSent:
			cls = append(cls, "comp-sent")
		}
		if current && in.State != saga.StateRunning && name == in.Step {
			cls = append(cls, "current")
		}
		d.Boxes = append(d.Boxes, dgBox{X: x, Y: y, W: dgBoxW, H: dgBoxH, Step: name, Label: "undo " + shorten(dgLabelN-5, name), Sub: "compensation", Class: strings.Join(cls, " "), Rx: 3})
		undoAt[name] = pos{x, y}
		// The step and its compensation, side by side.
		d.Edges = append(d.Edges, dgEdge{X1: p.x + dgBoxW, Y1: p.y + dgBoxH/2 - 8, X2: x, Y2: y + dgBoxH/2 - 8, Class: edgeClass("comp undo-link", mk.compSent)})
	}
	compY := dgMargin
	compCls := "end end-compensated"
	if in.State == saga.StateCompensated {
		compCls += " taken current"
	}
	d.Boxes = append(d.Boxes, dgBox{X: compX, Y: compY - 6, W: dgBoxW, H: 30, Label: "Compensated", Class: compCls, Rx: 15})
	// The chain runs from each compensation to the one before it.
	for i := len(undoChain) - 1; i >= 0; i-- {
		from := undoAt[undoChain[i]]
		to := pos{compX, compY - 6 + 30}
		fromDone := marks[undoChain[i]] != nil && marks[undoChain[i]].compDone
		taken := fromDone && in.State == saga.StateCompensated
		if i > 0 {
			to = undoAt[undoChain[i-1]]
			to.y += dgBoxH
			taken = fromDone && marks[undoChain[i-1]] != nil && marks[undoChain[i-1]].compSent
		}
		d.Edges = append(d.Edges, dgEdge{X1: from.x + dgBoxW/2, Y1: from.y, X2: to.x + dgBoxW/2, Y2: to.y, Class: edgeClass("comp", taken)})
	}
	// Where this instance's failure went: from the step that failed or
	// timed out to the first compensation sent after it (Compensated when
	// none was).
	if f, first, ok := failurePath(hist); ok {
		if p, ok := boxAt[f]; ok {
			to := pos{compX, compY - 6 + 15}
			if first != "" {
				if u, ok := undoAt[first]; ok {
					to = pos{u.x, u.y + dgBoxH/2}
				}
			}
			d.Edges = append(d.Edges, dgEdge{X1: p.x + dgBoxW, Y1: p.y + dgBoxH/2 + 8, X2: to.x, Y2: to.y, Class: "fail taken"})
		}
	}
	d.W = compX + dgBoxW + dgMargin
	d.H = endY + dgBoxH + dgMargin
	return d
}

// failurePath returns the step whose failure (a failure reply, a timeout
// of its command, a command that could not be sent) started the
// compensation, and the step whose compensation was sent first after it
// ("" for none).
func failurePath(hist []saga.HistoryEntry) (failed, first string, ok bool) {
	for i, e := range hist {
		isFail := (e.Kind == saga.KindReply || e.Kind == saga.KindCommand) && e.Error != "" || e.Kind == saga.KindTimeout
		if !isFail || e.Step == "" {
			continue
		}
		for _, n := range hist[i+1:] {
			if n.Kind == saga.KindCompensation {
				return e.Step, n.Step, true
			}
		}
		return e.Step, "", true
	}
	return "", "", false
}

func edgeClass(base string, taken bool) string {
	if taken {
		return base + " taken"
	}
	return base
}

// fmtTook is a step's duration, short.
func fmtTook(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return d.Round(time.Microsecond).String()
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(10 * time.Millisecond).String()
	}
	return roundAge(d)
}

// ganttBar is one step's span on the timeline picture: from its command
// (or compensation) to its reply.
type ganttBar struct {
	X, Y, W int
	Label   string
	Class   string
}

// sagaGantt is the timeline drawn to scale.
type sagaGantt struct {
	W, H int
	Bars []ganttBar
	// Total is the span from the first to the last entry.
	Total string
}

// Gantt geometry.
const (
	gtLabelW = 210
	gtBarW   = 560
	gtRowH   = 22
)

// layoutGantt draws each command → reply (and compensation → reply) span
// of hist to scale; an unanswered command runs to now.
func layoutGantt(hist []saga.HistoryEntry, now time.Time) *sagaGantt {
	if len(hist) == 0 {
		return nil
	}
	type span struct {
		label, class string
		from, to     time.Time
	}
	var spans []span
	open := map[string]int{} // step+phase → index of its open span
	for _, e := range hist {
		switch e.Kind {
		case saga.KindCommand, saga.KindWait, saga.KindTimer:
			open["f"+e.Step] = len(spans)
			spans = append(spans, span{label: e.Step, class: "gt-forward", from: e.At})
		case saga.KindCompensation:
			open["c"+e.Step] = len(spans)
			spans = append(spans, span{label: "undo " + e.Step, class: "gt-compensation", from: e.At})
		case saga.KindReply, saga.KindTimerFired, saga.KindTimeout:
			if i, ok := open["f"+e.Step]; ok {
				spans[i].to = e.At
				if e.Error != "" || e.Kind == saga.KindTimeout {
					spans[i].class = "gt-failed"
				}
				delete(open, "f"+e.Step)
			} else if i, ok := open["c"+e.Step]; ok && e.Kind == saga.KindTimeout {
				spans[i].to, spans[i].class = e.At, "gt-failed"
				delete(open, "c"+e.Step)
			}
		case saga.KindCompensationReply:
			if i, ok := open["c"+e.Step]; ok {
				spans[i].to = e.At
				if e.Error != "" {
					spans[i].class = "gt-failed"
				}
				delete(open, "c"+e.Step)
			}
		}
	}
	start, end := hist[0].At, hist[len(hist)-1].At
	for i := range spans {
		if spans[i].to.IsZero() {
			spans[i].to = now
			spans[i].class += " gt-open"
		}
		if spans[i].to.After(end) {
			end = spans[i].to
		}
	}
	total := end.Sub(start)
	g := &sagaGantt{W: gtLabelW + gtBarW + 90, H: len(spans)*gtRowH + 8, Total: fmtTook(total)}
	for i, s := range spans {
		x, w := gtLabelW, 2
		if total > 0 {
			x = gtLabelW + int(float64(s.from.Sub(start))/float64(total)*gtBarW)
			w = max(2, int(float64(s.to.Sub(s.from))/float64(total)*gtBarW))
		}
		g.Bars = append(g.Bars, ganttBar{X: x, Y: 4 + i*gtRowH, W: w, Label: fmt.Sprintf("%s · %s", shorten(dgLabelN, s.label), fmtTook(s.to.Sub(s.from))), Class: s.class})
	}
	return g
}
