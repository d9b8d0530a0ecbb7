package saga

import (
	"database/sql"
	"encoding/json"
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/millwright/millwright/outbox"
)

// Parallel branches: a Step whose Parallel field is set is a group; its
// branches (ordinary steps) are sent at once and the group succeeds when
// every branch has. In the definition the branches occupy consecutive
// indices of the flat step list (d.steps), so that replies still match by
// step name and compensation still walks the list backwards, skipping the
// branches that have nothing to undo (neither succeeded nor timed out).

// group is one group of a definition: its name and the flat indices of its
// branches, first..last.
type group struct {
	name        string
	first, last int
}

// addGroup flattens group step s (declared at position pos of saga name)
// into d: its branches become steps. It returns what is wrong with it.
func (d *Definition[D]) addGroup(name string, pos int, s Step[D]) []error {
	var errs []error
	where := fmt.Sprintf("saga: %q step %d (%q)", name, pos, s.Name)
	if !nameRE.MatchString(s.Name) {
		errs = append(errs, fmt.Errorf("saga: %q step %d: Name %q: want letters, digits, '_', '-' or '.', not empty", name, pos, s.Name))
	}
	if len(s.Parallel) < 2 {
		errs = append(errs, fmt.Errorf("%s: Parallel has %d branch(es): a group needs at least 2; make a single branch an ordinary step", where, len(s.Parallel)))
	}
	var set []string
	for _, f := range []struct {
		name string
		set  bool
	}{
		{"Command", s.Command != nil}, {"OnSuccess", s.OnSuccess != nil}, {"Compensation", s.Compensation != nil},
		{"NoCompensation", s.NoCompensation}, {"SuccessReply", s.SuccessReply != ""}, {"FailureReply", s.FailureReply != ""},
		{"CompensatedReply", s.CompensatedReply != ""}, {"CompensationFailedReply", s.CompensationFailedReply != ""},
		{"Timeout", s.Timeout != 0}, {"CompensationTimeout", s.CompensationTimeout != 0},
	} {
		if f.set {
			set = append(set, f.name)
		}
	}
	if len(set) > 0 {
		errs = append(errs, fmt.Errorf("%s: a group (Parallel set) sends no command of its own, but %s set: move them to its branches",
			where, strings.Join(set, ", ")+map[bool]string{true: " is", false: " are"}[len(set) == 1]))
	}
	g := group{name: s.Name, first: len(d.steps)}
	for j, b := range s.Parallel {
		if b.Parallel != nil {
			errs = append(errs, fmt.Errorf("%s branch %d (%q): Parallel is set: a branch cannot itself be a group; declare its branches in the outer group", where, j, b.Name))
			continue
		}
		if !nameRE.MatchString(b.Name) {
			errs = append(errs, fmt.Errorf("%s branch %d: Name %q: want letters, digits, '_', '-' or '.', not empty", where, j, b.Name))
		} else if _, dup := d.index[b.Name]; dup {
			errs = append(errs, fmt.Errorf("%s branch %d: Name %q is used by an earlier step or branch: step and branch names must be unique within the saga", where, j, b.Name))
		}
		d.index[b.Name] = len(d.steps)
		b = b.withDefaults()
		errs = append(errs, b.check(name)...)
		d.steps = append(d.steps, b)
	}
	g.last = len(d.steps) - 1
	if g.last >= g.first {
		d.groups = append(d.groups, g)
	}
	return errs
}

// checkGroupNames returns an error for each group whose name is also the
// name of a step, a branch or another group of saga name.
func (d *Definition[D]) checkGroupNames(name string) []error {
	var errs []error
	seen := map[string]bool{}
	for _, g := range d.groups {
		if _, dup := d.index[g.name]; dup || seen[g.name] {
			errs = append(errs, fmt.Errorf("saga: %q group %q: Name is also used by another step, branch or group: names must be unique within the saga", name, g.name))
		}
		seen[g.name] = true
	}
	return errs
}

// groupAt returns the group step index i is a branch of, if any.
func (d *Definition[D]) groupAt(i int) (group, bool) {
	for _, g := range d.groups {
		if i >= g.first && i <= g.last {
			return g, true
		}
	}
	return group{}, false
}

// Branch states (BranchInfo.State).
const (
	BranchRunning   = "running"
	BranchSucceeded = "succeeded"
	BranchFailed    = "failed"
	BranchTimedOut  = "timed_out"
)

// BranchInfo is the state of one branch of a parallel group, as stored in
// the instance's branches column (a JSON object keyed by branch name) and
// shown by Info.Branches. Entries stay after the group completes, so that
// a later step's failure compensates the branches.
type BranchInfo struct {
	// State is BranchRunning, BranchSucceeded, BranchFailed or
	// BranchTimedOut.
	State string `json:"state"`
	// Deadline of a running branch.
	Deadline time.Time `json:"deadline,omitzero"`
	// LateSuccess: a timed-out branch whose success arrived while its
	// group still ran (it stays timed out: the group failed).
	LateSuccess bool `json:"late_success,omitempty"`
}

// marshalBranches is the branches column of in (nil: NULL).
func marshalBranches(b map[string]BranchInfo) []byte {
	if len(b) == 0 {
		return nil
	}
	raw, _ := json.Marshal(b) // strings and times only: cannot fail
	return raw
}

// branchesOf reads the branches column. The orchestrator alone writes it
// (marshalBranches); should it ever be unreadable it reads as no entry, and
// a decision on the running group refuses the instance (checkBranches).
func branchesOf(raw []byte) map[string]BranchInfo {
	var b map[string]BranchInfo
	if len(raw) == 0 || json.Unmarshal(raw, &b) != nil {
		return nil
	}
	return b
}

// runningGroup returns the group instance in is running (its branches
// sent, not all answered), if any.
func (d decider[D]) runningGroup(in instance) (group, bool) {
	if in.state != StateRunning || in.step < 0 {
		return group{}, false
	}
	return d.def.groupAt(in.step)
}

// compensable reports whether step i has something to undo when the
// compensation chain reaches it: a Compensation, and for a branch, a
// success or a timeout (its effect is unknown). A branch that failed, or
// whose group was never entered, is skipped.
func (d decider[D]) compensable(in instance, i int) bool {
	s := d.def.steps[i]
	if s.Compensation == nil {
		return false
	}
	if _, ok := d.def.groupAt(i); !ok {
		return true
	}
	st := in.branches[s.Name].State
	return st == BranchSucceeded || st == BranchTimedOut
}

// lateSuccessPossible reports, for a stale success reply of step i, whether
// its command was sent and timed out: always for an ordinary step (forward
// commands are sent in order), for a branch only when its entry says so.
func (d decider[D]) lateSuccessPossible(in instance, i int) bool {
	if _, ok := d.def.groupAt(i); !ok {
		return true
	}
	st := in.branches[d.def.steps[i].Name]
	return st.State == BranchTimedOut && !st.LateSuccess
}

// sendGroup enters group g: every branch's command is sent in this
// transition, each branch with its own deadline; the instance's deadline
// is the earliest. A branch whose command cannot be built fails the whole
// entry: nothing is sent (the caller fails the saga at the group).
func (d decider[D]) sendGroup(t *transition, g group, data D, now time.Time) error {
	var evs []outbox.Event
	var hist []histRow
	branches := maps.Clone(t.in.branches)
	if branches == nil {
		branches = make(map[string]BranchInfo, g.last-g.first+1)
	}
	var deadline time.Time
	for i := g.first; i <= g.last; i++ {
		s := d.def.steps[i]
		cmd, err := s.Command(data)
		if err != nil {
			return fmt.Errorf("group %q branch %q: building command: %w", g.name, s.Name, err)
		}
		ev, err := d.event(t.in.id, s.Name, PhaseForward, 1, cmd)
		if err != nil {
			return fmt.Errorf("group %q branch %q: %w", g.name, s.Name, err)
		}
		evs = append(evs, ev)
		hist = append(hist, histRow{step: s.Name, kind: KindCommand, detail: cmd.Type, attempt: 1})
		dl := now.Add(s.Timeout)
		branches[s.Name] = BranchInfo{State: BranchRunning, Deadline: dl}
		if deadline.IsZero() || dl.Before(deadline) {
			deadline = dl
		}
	}
	t.in.state, t.in.step, t.in.awaiting = StateRunning, g.first, true
	t.in.deadline = sql.NullTime{Time: deadline, Valid: true}
	t.in.branches = branches
	t.events = append(t.events, evs...)
	t.hist = append(t.hist, hist...)
	return nil
}

// groupReply handles forward reply r when instance in runs the group r's
// step is a branch of; ok is false for any other reply (decided as
// before).
func (d decider[D]) groupReply(in instance, r replyInfo, h history, now time.Time) (t *transition, ok bool, err error) {
	g, running := d.runningGroup(in)
	if !running || r.phase != PhaseForward || r.stepIdx < g.first || r.stepIdx > g.last {
		return nil, false, nil
	}
	if err := d.checkBranches(in, g); err != nil {
		return nil, true, err
	}
	t, err = d.onBranchReply(in, g, r, h, now)
	return t, true, err
}

// checkBranches refuses an instance running group g without an entry for
// each of its branches (the branches column lost, or the group added to
// the definition while the saga ran at one of its indices): deciding on
// it would take the missing branches for answered.
func (d decider[D]) checkBranches(in instance, g group) error {
	for i := g.first; i <= g.last; i++ {
		if name := d.def.steps[i].Name; in.branches[name].State == "" {
			return fmt.Errorf("saga %s %q: running group %q, but the instance has no state for its branch %q: %w; "+
				"was the group added to the definition while the saga ran? Compensate the saga by hand "+
				"and record it with `millwright saga resolve %s --action skip`", d.def.name, in.id, g.name, name, ErrUnknownPosition, in.id)
		}
	}
	return nil
}

// onBranchReply is branch r.stepIdx's reply while its group runs.
func (d decider[D]) onBranchReply(in instance, g group, r replyInfo, h history, now time.Time) (*transition, error) {
	s := d.def.steps[r.stepIdx]
	st := in.branches[s.Name]
	success := r.reply.Type == s.SuccessReply
	switch {
	case st.State == BranchRunning,
		st.State == BranchTimedOut && !st.LateSuccess && success && s.Compensation != nil:
	default:
		// Answered already (a redelivery), or a timed-out branch's
		// failure (or the success of one with nothing to undo): recorded
		// and ignored; a timed-out branch is compensated anyway.
		kind := KindDuplicate
		if st.State == BranchTimedOut && !st.LateSuccess {
			kind = KindLateReply
		}
		t := &transition{in: instance{id: in.id}}
		t.record(s.Name, kind, r.reply.Type, r.attempt, "")
		t.note(note{what: noteIgnored, step: s.Name, kind: kind, phase: r.phase, reply: r.reply.Type, attempt: r.attempt, state: in.state})
		return t, nil
	}
	t := &transition{in: in}
	t.in.branches = maps.Clone(in.branches)
	data, err := d.decode(in)
	if err != nil {
		return nil, err
	}
	switch {
	case success:
		kind := KindReply
		next := BranchInfo{State: BranchSucceeded}
		if st.State == BranchTimedOut {
			// Its effect happened after all. The group failed (it
			// timed out) and still awaits other branches, so the
			// compensation sent once they are done comes after it.
			kind, next = KindLateSuccess, BranchInfo{State: BranchTimedOut, LateSuccess: true}
			t.note(note{what: noteLateSuccess, step: s.Name, state: in.state})
		}
		t.record(s.Name, kind, r.reply.Type, r.attempt, "")
		if err := d.applySuccess(t, s, &data, r); err != nil {
			return nil, err
		}
		t.in.branches[s.Name] = next
	default:
		e := replyError(r.reply)
		t.record(s.Name, KindReply, r.reply.Type, r.attempt, e)
		d.branchFailed(t, g, fmt.Sprintf("group %q branch %q failed: %s", g.name, s.Name, e))
		t.in.branches[s.Name] = BranchInfo{State: BranchFailed}
	}
	if err := d.settleGroup(t, g, data, h, now); err != nil {
		return nil, err
	}
	return t, nil
}

// branchFailed records the failure (or timeout) of a branch of g: the
// first one is the saga's cause; later ones are added to last_error.
func (d decider[D]) branchFailed(t *transition, g group, msg string) {
	if !d.groupFailing(t.in, g) {
		t.in.fail(msg)
		return
	}
	t.in.lastError = t.in.since(msg)
}

// groupFailing reports whether a branch of g failed or timed out.
func (d decider[D]) groupFailing(in instance, g group) bool {
	for i := g.first; i <= g.last; i++ {
		if st := in.branches[d.def.steps[i].Name].State; st == BranchFailed || st == BranchTimedOut {
			return true
		}
	}
	return false
}

// settleGroup decides what group g does next, its branches' entries
// updated: wait for the branches still running (the deadline is the
// earliest of theirs), go on with the next step when all succeeded, or
// compensate (the branches that succeeded or timed out, last declared
// first, then the steps before the group).
func (d decider[D]) settleGroup(t *transition, g group, data D, h history, now time.Time) error {
	var deadline time.Time
	for i := g.first; i <= g.last; i++ {
		st := t.in.branches[d.def.steps[i].Name]
		if st.State == BranchRunning && (deadline.IsZero() || st.Deadline.Before(deadline)) {
			deadline = st.Deadline
		}
	}
	if !deadline.IsZero() {
		t.in.deadline = sql.NullTime{Time: deadline, Valid: true}
		return nil
	}
	if d.groupFailing(t.in, g) {
		return d.compensateFrom(t, g.last, data, h, now)
	}
	last := d.def.steps[g.last]
	if g.last+1 == len(d.def.steps) {
		t.in.state, t.in.deadline, t.in.awaiting = StateCompleted, sql.NullTime{}, false
		t.record(last.Name, KindCompleted, "", 0, "")
		t.note(note{what: noteCompleted, step: last.Name})
		return nil
	}
	if err := d.sendCommand(t, g.last+1, data, now); err != nil {
		// As onSuccess: the next step cannot be asked; the group (and
		// the steps before it) are compensated.
		msg := err.Error()
		t.record(d.def.steps[g.last+1].Name, KindCommand, "", 1, msg)
		t.in.fail(msg)
		return d.compensateFrom(t, g.last, data, h, now)
	}
	return nil
}

// groupDeadline handles the passed deadline of instance in while it runs
// a group: the branches whose own deadline passed time out. ok is false
// when in runs no group. The instance's deadline (the earliest branch's)
// passed by the database's clock, so its branch is due even if now, the
// orchestrator's clock, is a little behind: the round makes progress.
func (d decider[D]) groupDeadline(t *transition, data D, h history, now time.Time) (ok bool, err error) {
	g, running := d.runningGroup(t.in)
	if !running {
		return false, nil
	}
	if err := d.checkBranches(t.in, g); err != nil {
		return true, err
	}
	t.in.branches = maps.Clone(t.in.branches)
	due := now
	if t.in.deadline.Valid && t.in.deadline.Time.After(due) {
		due = t.in.deadline.Time
	}
	for i := g.first; i <= g.last; i++ {
		s := d.def.steps[i]
		st := t.in.branches[s.Name]
		if st.State != BranchRunning || st.Deadline.After(due) {
			continue
		}
		msg := fmt.Sprintf("group %q branch %q timed out after %s", g.name, s.Name, s.Timeout)
		t.record(s.Name, KindTimeout, "", 1, msg)
		t.note(note{what: noteTimeout, step: s.Name})
		d.branchFailed(t, g, msg)
		t.in.branches[s.Name] = BranchInfo{State: BranchTimedOut}
	}
	return true, d.settleGroup(t, g, data, h, now)
}

// mermaidWithGroups is Mermaid for a definition with parallel groups: each
// group is a composite state whose branches fork and join; the compensation
// chain walks the steps and branches backwards, as the decider does.
func (d *Definition[D]) mermaidWithGroups() string {
	var b strings.Builder
	id := func(s string) string { return strings.NewReplacer(".", "_", "-", "_").Replace(s) }
	// node is the diagram state of step index i: its group's, or its own.
	node := func(i int) string {
		if g, ok := d.groupAt(i); ok {
			return id(g.name)
		}
		return id(d.steps[i].Name)
	}
	compTarget := func(i int) string {
		for j := i; j >= 0; j-- {
			if d.steps[j].Compensation != nil {
				return "undo_" + id(d.steps[j].Name)
			}
		}
		return "Compensated"
	}
	fmt.Fprintf(&b, "stateDiagram-v2\n")
	fmt.Fprintf(&b, "    %%%% saga %s\n", d.name)
	fmt.Fprintf(&b, "    [*] --> %s\n", node(0))
	for i := 0; i < len(d.steps); i++ {
		g, isGroup := d.groupAt(i)
		last := i
		if isGroup {
			last = g.last
		}
		next := "Completed"
		if last+1 < len(d.steps) {
			next = node(last + 1)
		}
		if !isGroup {
			s := d.steps[i]
			fmt.Fprintf(&b, "    %s --> %s: %s\n", id(s.Name), next, s.SuccessReply)
			fmt.Fprintf(&b, "    %s --> %s: %s\n", id(s.Name), compTarget(i-1), s.FailureReply)
			fmt.Fprintf(&b, "    %s --> %s: timeout %s\n", id(s.Name), compTarget(i), s.Timeout)
			continue
		}
		gid := id(g.name)
		fmt.Fprintf(&b, "    state %s {\n", gid)
		fmt.Fprintf(&b, "        state %s_fork <<fork>>\n", gid)
		fmt.Fprintf(&b, "        state %s_join <<join>>\n", gid)
		fmt.Fprintf(&b, "        [*] --> %s_fork\n", gid)
		for j := g.first; j <= g.last; j++ {
			s := d.steps[j]
			fmt.Fprintf(&b, "        %s_fork --> %s\n", gid, id(s.Name))
			fmt.Fprintf(&b, "        %s --> %s_join: %s, %s or timeout %s\n", id(s.Name), gid, s.SuccessReply, s.FailureReply, s.Timeout)
		}
		fmt.Fprintf(&b, "        %s_join --> [*]\n", gid)
		fmt.Fprintf(&b, "    }\n")
		fmt.Fprintf(&b, "    %s --> %s: every branch succeeded\n", gid, next)
		// Which compensation comes first depends on which branches
		// succeeded or timed out (the failed ones are skipped).
		for _, to := range groupCompTargets(d, g, g.last, compTarget) {
			fmt.Fprintf(&b, "    %s --> %s: a branch failed or timed out\n", gid, to)
		}
		fmt.Fprintf(&b, "    note right of %s: after a failure the running branches are awaited; then the branches that succeeded or timed out are compensated, the failed ones skipped\n", gid)
		i = g.last
	}
	stuck := false
	for i := len(d.steps) - 1; i >= 0; i-- {
		s := d.steps[i]
		if s.Compensation == nil {
			continue
		}
		stuck = true
		u := "undo_" + id(s.Name)
		targets := []string{compTarget(i - 1)}
		if g, ok := d.groupAt(i); ok {
			targets = groupCompTargets(d, g, i-1, compTarget)
		}
		for _, to := range targets {
			fmt.Fprintf(&b, "    %s --> %s: %s\n", u, to, s.CompensatedReply)
		}
		fmt.Fprintf(&b, "    %s --> %s: %s (retry)\n", u, u, s.CompensationFailedReply)
		fmt.Fprintf(&b, "    %s --> Stuck: retries exhausted\n", u)
	}
	for i := len(d.steps) - 1; i >= 0; i-- {
		if s := d.steps[i]; s.Compensation != nil {
			fmt.Fprintf(&b, "    Compensated --> undo_%s: %s late\n", id(s.Name), s.SuccessReply)
		}
	}
	if stuck {
		fmt.Fprintf(&b, "    note right of Stuck: millwright saga resolve ID (retry or skip)\n")
	}
	fmt.Fprintf(&b, "    Completed --> [*]\n")
	fmt.Fprintf(&b, "    Compensated --> [*]\n")
	return b.String()
}

// groupCompTargets are the compensations that may come next from branch
// index i of group g down (i < g.first: none of the group's): any branch
// with a Compensation at or below i, else the first one before the group.
func groupCompTargets[D any](d *Definition[D], g group, i int, compTarget func(int) string) []string {
	var out []string
	for j := i; j >= g.first; j-- {
		if d.steps[j].Compensation != nil {
			out = append(out, compTarget(j))
		}
	}
	return append(out, compTarget(g.first-1))
}
