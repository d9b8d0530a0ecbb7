package saga

import (
	"fmt"
	"strings"
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
