package saga

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Versions of a saga type. An instance runs on the definition version it
// started on, to its end (or until an operator migrates it, migrate.go):
// the orchestrator keeps older versions (Config.Versions) and decides each
// instance with its own version's decider. The step graph of each version
// has a fingerprint, stored with the instances, so that a definition whose
// steps changed under an unchanged version is refused while instances of
// that version are running (CheckVersions).

// defVersion is a Definition's version and the fingerprint of its step
// graph (computed once, on first use).
type defVersion struct {
	version int
	once    sync.Once
	graph   string
	fp      string
}

// DefineVersion declares version version (1 or more) of the saga type
// named name. Define is DefineVersion with version 1. A changed
// definition (a step inserted, removed, renamed or reordered, reply types
// or a compensation changed) needs a new version while instances of the
// old one run: register the old one in Config.Versions, so its instances
// end by its own steps.
func DefineVersion[D any](name string, version int, steps ...Step[D]) (*Definition[D], error) {
	d, err := Define(name, steps...)
	if version < 1 {
		err = errors.Join(err, fmt.Errorf("saga: DefineVersion(%q, %d): version must be 1 or more", name, version))
	}
	if err != nil {
		return nil, err
	}
	d.v.version = version
	return d, nil
}

// Version returns the definition's version (1 for Define).
func (d *Definition[D]) Version() int {
	if d.v.version == 0 {
		return 1
	}
	return d.v.version
}

// Fingerprint returns a hash of the definition's step graph (see graph):
// what is stored with every instance started on it.
func (d *Definition[D]) Fingerprint() string {
	d.v.once.Do(func() {
		d.v.graph = d.graph()
		sum := sha256.Sum256([]byte(d.v.graph))
		d.v.fp = hex.EncodeToString(sum[:16])
	})
	return d.v.fp
}

// graphText returns graph(), computed once.
func (d *Definition[D]) graphText() string {
	d.Fingerprint()
	return d.v.graph
}

// graph is the canonical text of the step graph: one line per step, in
// order, "step NAME" then tab-separated key=value fields (values quoted).
// It holds what a running instance depends on: the steps' order and names
// (current_step is an index, replies name their step), their reply types
// and whether they have a compensation. Timeouts and retry policies are
// left out: changing them is safe for running instances. A field added to
// Step that changes how an instance proceeds adds a field here.
func (d *Definition[D]) graph() string {
	var b strings.Builder
	for i, s := range d.steps {
		fmt.Fprintf(&b, "step %s\tsuccess=%s\tfailure=%s", s.Name, strconv.Quote(s.SuccessReply), strconv.Quote(s.FailureReply))
		if s.Compensation != nil {
			fmt.Fprintf(&b, "\tcompensation=yes\tcompensated=%s\tcompensation_failed=%s",
				strconv.Quote(s.CompensatedReply), strconv.Quote(s.CompensationFailedReply))
		} else {
			b.WriteString("\tcompensation=no")
		}
		// What kind of step it is, when not an ordinary command: how an
		// instance at it proceeds depends on it.
		if k := d.stepKind(i); k != "command" {
			fmt.Fprintf(&b, "\tkind=%s", strconv.Quote(k))
		}
		if g, ok := d.groupAt(i); ok {
			fmt.Fprintf(&b, "\tgroup=%s", strconv.Quote(g.name))
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// stepKind names how step i proceeds: "command" (an ordinary step or a
// branch), "retriable", "wait EVENT" or "timer".
func (d *Definition[D]) stepKind(i int) string {
	s := d.steps[i]
	switch {
	case s.WaitFor != "":
		return "wait " + s.WaitFor
	case s.Sleep != 0 || s.Until != nil:
		return "timer"
	case s.Retriable:
		return "retriable"
	}
	return "command"
}

// graphStep is one "step" line of a graph.
type graphStep struct {
	name   string
	fields []string // key=value, in order
}

func parseGraph(g string) (steps []graphStep, other []string) {
	for _, line := range strings.Split(strings.TrimRight(g, "\n"), "\n") {
		if rest, ok := strings.CutPrefix(line, "step "); ok {
			f := strings.Split(rest, "\t")
			steps = append(steps, graphStep{name: f[0], fields: f[1:]})
		} else if line != "" {
			other = append(other, line)
		}
	}
	return steps, other
}

// graphChanges names what changed from step graph old to graph new, in
// the terms of an operator: steps inserted, removed, renamed, reordered,
// or a step's fields changed. Empty when the graphs are equal.
func graphChanges(old, new string) []string {
	if old == new {
		return nil
	}
	os, oo := parseGraph(old)
	ns, no := parseGraph(new)
	oi, ni := map[string]int{}, map[string]int{}
	for i, s := range os {
		oi[s.name] = i
	}
	for i, s := range ns {
		ni[s.name] = i
	}
	var out []string
	renamedFrom, renamedTo := map[string]bool{}, map[string]bool{}
	// A step gone from one index and another new at that index: renamed.
	for i, s := range os {
		if _, ok := ni[s.name]; ok || i >= len(ns) {
			continue
		}
		if _, ok := oi[ns[i].name]; !ok {
			out = append(out, fmt.Sprintf("step %q renamed to %q", s.name, ns[i].name))
			renamedFrom[s.name], renamedTo[ns[i].name] = true, true
		}
	}
	for i, s := range ns {
		if _, ok := oi[s.name]; ok || renamedTo[s.name] {
			continue
		}
		where := "at the end"
		for _, n := range ns[i+1:] {
			if _, ok := oi[n.name]; ok {
				where = fmt.Sprintf("before %q", n.name)
				break
			}
		}
		out = append(out, fmt.Sprintf("step %q inserted %s", s.name, where))
	}
	for i, s := range os {
		if _, ok := ni[s.name]; ok || renamedFrom[s.name] {
			continue
		}
		where := "last"
		for _, n := range os[i+1:] {
			if _, ok := ni[n.name]; ok {
				where = fmt.Sprintf("before %q", n.name)
				break
			}
		}
		out = append(out, fmt.Sprintf("step %q removed (it came %s)", s.name, where))
	}
	// The steps both have, in each one's order.
	var co, cn []string
	for _, s := range os {
		if _, ok := ni[s.name]; ok {
			co = append(co, s.name)
		}
	}
	for _, s := range ns {
		if _, ok := oi[s.name]; ok {
			cn = append(cn, s.name)
		}
	}
	if !slices.Equal(co, cn) {
		out = append(out, fmt.Sprintf("steps reordered: %s became %s", strings.Join(co, ", "), strings.Join(cn, ", ")))
	}
	for _, s := range os {
		j, ok := ni[s.name]
		if !ok {
			continue
		}
		if d := fieldChanges(s.fields, ns[j].fields); d != "" {
			out = append(out, fmt.Sprintf("step %q changed: %s", s.name, d))
		}
	}
	if len(out) == 0 && !slices.Equal(oo, no) {
		out = append(out, fmt.Sprintf("the step graph changed: %q became %q", strings.Join(oo, "; "), strings.Join(no, "; ")))
	}
	if len(out) == 0 {
		out = append(out, "the step graph changed")
	}
	return out
}

// fieldChanges names the fields that differ, "key old became new".
func fieldChanges(old, new []string) string {
	kv := func(fs []string) (keys []string, m map[string]string) {
		m = map[string]string{}
		for _, f := range fs {
			k, v, _ := strings.Cut(f, "=")
			keys = append(keys, k)
			m[k] = v
		}
		return keys, m
	}
	ok, om := kv(old)
	nk, nm := kv(new)
	var out []string
	seen := map[string]bool{}
	for _, k := range append(ok, nk...) {
		if seen[k] {
			continue
		}
		seen[k] = true
		ov, inOld := om[k]
		nv, inNew := nm[k]
		switch {
		case !inOld:
			out = append(out, fmt.Sprintf("%s %s added", k, nv))
		case !inNew:
			out = append(out, fmt.Sprintf("%s %s removed", k, ov))
		case ov != nv:
			out = append(out, fmt.Sprintf("%s %s became %s", k, ov, nv))
		}
	}
	return strings.Join(out, ", ")
}

// Versioned is a saga definition an orchestrator runs beside its own
// (Config.Versions): every *Definition[X] is one, whatever its data type
// X. Its unexported methods give the orchestrator a decider that does not
// depend on X.
type Versioned interface {
	Name() string
	Version() int
	Steps() []string
	Fingerprint() string
	graphText() string
	stepDecider(cfg Config) stepDecider
	// shape is the steps as a migration checks them.
	shape() []stepShape
}

// stepDecider is a decider of any data type (decider[X]).
type stepDecider interface {
	decide(in instance, inp input, h history, now time.Time) (*transition, error)
	parseReply(msg *message.Message) (replyInfo, error)
	reindex(r replyInfo) (replyInfo, error)
	setAside(in instance, reason string) *transition
	setAsideRefused(in instance, t *transition, reason string, keepData bool) *transition
}

var _ Versioned = (*Definition[struct{}])(nil)

func (d *Definition[D]) stepDecider(cfg Config) stepDecider { return decider[D]{def: d, cfg: cfg} }

// stepShape is what a migration checks of a step.
type stepShape struct {
	name                   string
	success, failure       string
	compensation           bool
	compensated, compFails string
	// kind is stepKind's; group the parallel group the step is a branch
	// of ("" for none).
	kind, group string
}

func (d *Definition[D]) shape() []stepShape {
	out := make([]stepShape, len(d.steps))
	for i, s := range d.steps {
		out[i] = stepShape{name: s.Name, success: s.SuccessReply, failure: s.FailureReply, compensation: s.Compensation != nil,
			compensated: s.CompensatedReply, compFails: s.CompensationFailedReply, kind: d.stepKind(i)}
		if g, ok := d.groupAt(i); ok {
			out[i].group = g.name
		}
	}
	return out
}

// reindex is r (parsed by another version's decider) with the step index
// of this version, checked against this version's steps: a reply is
// matched to an instance's step by name, in the instance's version.
func (d decider[D]) reindex(r replyInfo) (replyInfo, error) {
	idx, ok := d.def.index[r.step]
	if !ok {
		return r, fmt.Errorf("saga %s %q: reply names step %q, which version %d of the saga does not have (its steps: %s)",
			d.def.name, r.sagaID, r.step, d.def.Version(), strings.Join(d.def.Steps(), ", "))
	}
	s := d.def.steps[idx]
	want := []string{s.SuccessReply, s.FailureReply}
	if r.phase == PhaseCompensation {
		want = []string{s.CompensatedReply, s.CompensationFailedReply}
	}
	if r.reply.Type != want[0] && r.reply.Type != want[1] {
		return r, fmt.Errorf("saga %s %q: step %q %s reply has type %q, but version %d of the saga wants %q or %q",
			d.def.name, r.sagaID, r.step, r.phase, r.reply.Type, d.def.Version(), want[0], want[1])
	}
	r.stepIdx = idx
	return r, nil
}

// ErrVersionNotRegistered is returned (wrapped) by HandleReply for a reply
// to an instance whose definition version the orchestrator does not run:
// the instance is left as it is (never decided by another version), and
// the error names the fix: register that version's definition in
// Config.Versions. The reply is not marked failure.Permanent: during a
// rolling deploy another process that runs the version takes its
// redelivery. RunOnce never claims such instances.
var ErrVersionNotRegistered = errors.New("saga: the instance's definition version is not registered with this orchestrator")

// ErrDefinitionChanged is returned (wrapped) by CheckVersions and Run when
// a registered version's step graph differs from the one its running
// instances started on (the steps changed under an unchanged version),
// and by HandleReply for a reply to such an instance, which is left as it
// is. The error names the change and the fix: give the changed
// definition a new version (DefineVersion) and keep the old one
// registered in Config.Versions.
var ErrDefinitionChanged = errors.New("saga: the definition's steps changed under an unchanged version")

// version is one definition version an orchestrator runs.
type version struct {
	def Versioned
	d   stepDecider
	fp  string
}

// versionSet is the versions an orchestrator runs: its own definition's
// and Config.Versions.
type versionSet struct {
	name string
	own  int
	by   map[int]version
	// nums and fps are the registered versions and their fingerprints,
	// in order, for the claim of due deadlines.
	nums []int64
	fps  []string
	migs []Migration
	// refused is CheckVersions' last ErrDefinitionChanged: Start refuses
	// too, rather than start instances on a graph that was refused.
	refused *refusal
}

// refusal holds an error across goroutines.
type refusal struct {
	mu  sync.Mutex
	err error
}

func (r *refusal) set(err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.err = err
}

func (r *refusal) get() error {
	if r == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err
}

// newVersionSet checks cfg.Versions and cfg.Migrations against own.
func newVersionSet(own Versioned, cfg Config) (versionSet, error) {
	vs := versionSet{name: own.Name(), own: own.Version(), by: map[int]version{}, refused: &refusal{}}
	var errs []error
	add := func(v Versioned, what string) {
		if v == nil || isNil(v) {
			errs = append(errs, fmt.Errorf("saga: %s is nil: pass a *saga.Definition built with saga.DefineVersion", what))
			return
		}
		if v.Name() != own.Name() {
			errs = append(errs, fmt.Errorf("saga %s: %s is saga %q version %d: Config.Versions holds older versions of the orchestrator's own saga type only (one orchestrator per type)",
				own.Name(), what, v.Name(), v.Version()))
			return
		}
		if _, dup := vs.by[v.Version()]; dup {
			errs = append(errs, fmt.Errorf("saga %s: %s is version %d, which is already registered (the orchestrator's definition or an earlier entry): give each definition its own version",
				own.Name(), what, v.Version()))
			return
		}
		vs.by[v.Version()] = version{def: v, d: v.stepDecider(cfg), fp: v.Fingerprint()}
	}
	add(own, "the orchestrator's definition")
	for i, v := range cfg.Versions {
		add(v, fmt.Sprintf("Config.Versions[%d]", i))
	}
	for n := range vs.by {
		vs.nums = append(vs.nums, int64(n))
	}
	slices.Sort(vs.nums)
	for _, n := range vs.nums {
		vs.fps = append(vs.fps, vs.by[int(n)].fp)
	}
	from := map[int]bool{}
	for i, m := range cfg.Migrations {
		what := fmt.Sprintf("Config.Migrations[%d]", i)
		switch {
		case m.from == nil || m.to == nil:
			errs = append(errs, fmt.Errorf("saga %s: %s is empty: build it with saga.Migrate(from, to, fn)", own.Name(), what))
			continue
		case m.from.Name() != own.Name() || m.to.Name() != own.Name():
			errs = append(errs, fmt.Errorf("saga %s: %s migrates saga %q to %q: migrations are between versions of the orchestrator's own type",
				own.Name(), what, m.from.Name(), m.to.Name()))
			continue
		case m.from.Version() == m.to.Version():
			errs = append(errs, fmt.Errorf("saga %s: %s migrates version %d to itself: a migration moves instances to another version", own.Name(), what, m.from.Version()))
			continue
		case from[m.from.Version()]:
			errs = append(errs, fmt.Errorf("saga %s: %s: a migration from version %d is declared twice: keep one", own.Name(), what, m.from.Version()))
			continue
		}
		from[m.from.Version()] = true
		for _, end := range []Versioned{m.from, m.to} {
			if v, ok := vs.by[end.Version()]; !ok || v.fp != end.Fingerprint() {
				errs = append(errs, fmt.Errorf("saga %s: %s: version %d is not the orchestrator's definition nor in Config.Versions (or is another definition of that version): register the definitions a migration moves instances between",
					own.Name(), what, end.Version()))
			}
		}
		vs.migs = append(vs.migs, m)
	}
	return vs, errors.Join(errs...)
}

// decider returns the decider of in's version, or an error (wrapping
// ErrVersionNotRegistered or ErrDefinitionChanged) naming the fix when
// this orchestrator does not run it.
func (vs versionSet) decider(in instance) (stepDecider, error) {
	v, ok := vs.by[in.defVersion]
	if !ok {
		return nil, fmt.Errorf("saga %s %q runs on definition version %d, which this orchestrator does not run (it runs version(s) %s): the instance is left as it is; register version %d's definition in saga.Config.Versions (until `millwright saga versions` shows none of its instances left): %w",
			vs.name, in.id, in.defVersion, vs.list(), in.defVersion, ErrVersionNotRegistered)
	}
	if in.fingerprint.Valid && in.fingerprint.String != v.fp {
		return nil, fmt.Errorf("saga %s %q started on version %d with step graph %s, but this orchestrator's version %d has step graph %s: the instance is left as it is; give the changed definition a new version (saga.DefineVersion) and register the one it started on in Config.Versions: %w",
			vs.name, in.id, in.defVersion, short(in.fingerprint.String), in.defVersion, short(v.fp), ErrDefinitionChanged)
	}
	return v.d, nil
}

// of returns the decider of in's version, for an instance decider
// accepted (setting it aside names its step in its own version).
func (vs versionSet) of(in instance, fallback stepDecider) stepDecider {
	if v, ok := vs.by[in.defVersion]; ok {
		return v.d
	}
	return fallback
}

func (vs versionSet) list() string {
	s := make([]string, len(vs.nums))
	for i, n := range vs.nums {
		s[i] = strconv.FormatInt(n, 10)
	}
	return strings.Join(s, ", ")
}

func short(fp string) string {
	if len(fp) > 12 {
		return fp[:12]
	}
	return fp
}

// parseReply parses msg with the orchestrator's definition, else with
// the first registered version that knows its step: the instance's own
// version re-checks it once the instance is loaded (reindex).
func (o *Orchestrator[D]) parseReply(msg *message.Message) (replyInfo, error) {
	r, err := o.d.parseReply(msg)
	if err == nil || len(o.vs.by) == 1 {
		return r, err
	}
	for _, n := range o.vs.nums {
		if int(n) == o.vs.own {
			continue
		}
		if r2, err2 := o.vs.by[int(n)].d.parseReply(msg); err2 == nil {
			return r2, nil
		}
	}
	return r, err
}

// versionFor returns the decider of in's version with r indexed in it,
// for applyReply; an error leaves the instance as it is.
func (o *Orchestrator[D]) versionFor(in instance, r replyInfo) (stepDecider, replyInfo, error) {
	d, err := o.vs.decider(in)
	if err != nil {
		o.cfg.Logger.Error("saga: reply to an instance of a version this orchestrator does not run; left as it is", err,
			watermill.LogFields{"saga_type": o.def.name, "saga_id": in.id, "def_version": in.defVersion, "step": r.step})
		return nil, r, err
	}
	r, err = d.reindex(r)
	return d, r, err
}

// CheckVersions checks the running instances against the versions the
// orchestrator runs: it returns an error wrapping ErrDefinitionChanged,
// naming each change (a step inserted, removed, renamed or reordered, a
// step's reply types or compensation changed), when instances not
// finished of a registered version started on another step graph than
// that version's definition has now. Otherwise it records each
// registered version's graph in millwright_saga_definitions, and logs an
// error for each version live instances run on that the orchestrator does
// not run (they are left as they are). Run calls it before its first
// round (and returns its ErrDefinitionChanged); a service may call it
// before it starts serving. Once it has returned ErrDefinitionChanged,
// Start returns that error too, until a CheckVersions passes.
func (o *Orchestrator[D]) CheckVersions(ctx context.Context) error {
	q := o.pool
	var errs []error
	for _, n := range o.vs.nums {
		v := o.vs.by[int(n)]
		others, err := storage.OtherSagaFingerprints(ctx, q, o.def.name, int(n), v.fp)
		if err != nil {
			return fmt.Errorf("saga %s: checking the running instances' versions%s: %w", o.def.name, storage.Hint(err), err)
		}
		for _, c := range others {
			graph, ok, err := storage.SagaDefinitionGraph(ctx, q, o.def.name, int(n), c.Fingerprint)
			if err != nil {
				return fmt.Errorf("saga %s: reading the definitions table%s: %w", o.def.name, storage.Hint(err), err)
			}
			what := fmt.Sprintf("the step graph changed (the instances have fingerprint %s, the definition %s; their graph is not recorded)", short(c.Fingerprint), short(v.fp))
			if ok {
				what = strings.Join(graphChanges(graph, v.def.graphText()), "; ")
			}
			errs = append(errs, fmt.Errorf("saga %q version %d: %s since the %d running instance(s) started; give the changed definition a new version (saga.DefineVersion) and keep version %d registered in Config.Versions: %w",
				o.def.name, n, what, c.Count, n, ErrDefinitionChanged))
		}
	}
	err := errors.Join(errs...)
	o.vs.refused.set(err)
	if err != nil {
		return err
	}
	for _, n := range o.vs.nums {
		v := o.vs.by[int(n)]
		if err := storage.RegisterSagaDefinition(ctx, q, o.def.name, int(n), v.fp, v.def.graphText()); err != nil {
			return fmt.Errorf("saga %s: registering version %d in millwright_saga_definitions%s: %w", o.def.name, n, storage.Hint(err), err)
		}
	}
	missing, err := storage.OtherSagaVersions(ctx, q, o.def.name, o.vs.nums)
	if err != nil {
		return fmt.Errorf("saga %s: counting instances per version%s: %w", o.def.name, storage.Hint(err), err)
	}
	for _, m := range missing {
		o.cfg.Logger.Error("saga: instances of a version this orchestrator does not run; they are left as they are",
			fmt.Errorf("saga %s: %d instance(s) not finished run on definition version %d, which this orchestrator does not run (it runs %s): register version %d's definition in saga.Config.Versions, or run an orchestrator that has it: %w",
				o.def.name, m.Count, m.Version, o.vs.list(), m.Version, ErrVersionNotRegistered),
			watermill.LogFields{"saga_type": o.def.name, "def_version": m.Version, "instances": m.Count})
	}
	return nil
}

// startupCheck is Run's check before its first round: the tables, then
// the versions.
func (o *Orchestrator[D]) startupCheck(ctx context.Context) error {
	if err := o.checkTables(ctx); err != nil {
		return err
	}
	return o.CheckVersions(ctx)
}

// claimDue claims the due deadlines of the versions the orchestrator runs.
func (o *Orchestrator[D]) claimDue(ctx context.Context, q storage.Querier) ([]storage.SagaInstance, error) {
	return storage.ClaimDueSagaVersions(ctx, q, o.def.name, o.vs.nums, o.vs.fps, o.cfg.BatchSize)
}

// VersionInfo counts the instances of one saga type's definition version.
type VersionInfo struct {
	Type    string
	Version int
	// Counts by state; a state without instances is absent.
	Counts map[State]int64
	// Live counts the instances not finished (running, compensating,
	// stuck): while it is above 0 the version must stay registered (the
	// orchestrator's definition or Config.Versions). At 0 it is retired:
	// remove it from Config.Versions.
	Live int64
	// Finished counts the completed and compensated instances.
	Finished int64
	// Fingerprints registered for the version (millwright_saga_definitions),
	// first registered first; empty for a version whose orchestrator has
	// not run since versions were introduced.
	Fingerprints []string
	// LastSeen is when an orchestrator running the version last started.
	LastSeen time.Time
}

// Retired reports whether no instance of the version is left to run.
func (v VersionInfo) Retired() bool { return v.Live == 0 }

// Versions counts the instances per saga type, definition version and
// state, with the versions registered in millwright_saga_definitions that
// have no instance left: by type, then version.
func Versions(ctx context.Context, db postgres.Handle) ([]VersionInfo, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("saga: Versions: %w", err)
	}
	rows, err := storage.SagaVersionStates(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("saga: counting instances per version%s: %w", storage.Hint(err), err)
	}
	defs, err := storage.SagaDefinitions(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("saga: reading millwright_saga_definitions%s: %w", storage.Hint(err), err)
	}
	type key struct {
		typ string
		v   int
	}
	by := map[key]*VersionInfo{}
	get := func(k key) *VersionInfo {
		if by[k] == nil {
			by[k] = &VersionInfo{Type: k.typ, Version: k.v, Counts: map[State]int64{}}
		}
		return by[k]
	}
	for _, r := range rows {
		v := get(key{r.Type, r.Version})
		v.Counts[State(r.State)] += r.Count
		if s := State(r.State); s != StateCompleted && s != StateCompensated {
			v.Live += r.Count
		} else {
			v.Finished += r.Count
		}
	}
	for _, d := range defs {
		v := get(key{d.Type, d.Version})
		v.Fingerprints = append(v.Fingerprints, d.Fingerprint)
		if d.LastSeenAt.After(v.LastSeen) {
			v.LastSeen = d.LastSeenAt
		}
	}
	out := make([]VersionInfo, 0, len(by))
	for _, v := range by {
		out = append(out, *v)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Type != out[j].Type {
			return out[i].Type < out[j].Type
		}
		return out[i].Version < out[j].Version
	})
	return out, nil
}
