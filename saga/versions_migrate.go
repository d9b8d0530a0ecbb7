package saga

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Migration of running instances from one definition version to another:
// declared in Go (Migrate, in Config.Migrations), shown by a dry run
// (PlanMigration) and applied by an operator action (Orchestrator.Migrate),
// instance by instance, each in its own transaction with its audit row.
//
// What a migration can place: an instance running forward, waiting for the
// reply to its current step's command, moves to the step of the same name
// in the new version (the command is in flight and its reply names that
// step; nothing is sent by the migration). The declared function maps its
// data and may refuse it. An instance is not placed, and stays on its
// version (reported with the reason), when it is compensating or stuck,
// when the function refuses it or places it elsewhere, when the step's
// reply types or compensation differ between the versions, or when a
// later failure would compensate differently: the new version has a step
// with a compensation before that step that never ran for the instance,
// or a step that ran and has a compensation is gone from before it.
//
// Migration runs only as an operator action: applying one at each
// instance's next transition would change running instances without the
// review the dry run exists for, and would cost every transition a check.

// KindMigrated is the history kind of a migration to another definition
// version: its detail names both positions.
const KindMigrated = "migrated"

// Migration moves instances of one definition version to another; built
// by Migrate.
type Migration struct {
	from, to Versioned
	place    func(old []byte, at Position) ([]byte, Position, error)
}

// Position is where an instance stands in its version.
type Position struct {
	// Step is the name of the step whose command's reply the instance
	// waits for.
	Step string
}

// Migrate declares the migration of the live instances of definition
// from to definition to (both of the same saga type, registered with the
// orchestrator: its own definition or Config.Versions): fn maps an
// instance's data and position in from to its data and position in to,
// or returns an error to leave it on from (reported by PlanMigration and
// Orchestrator.Migrate). fn must be pure: the dry run calls it too.
func Migrate[Old, New any](from *Definition[Old], to *Definition[New], fn func(old Old, at Position) (New, Position, error)) Migration {
	if from == nil || to == nil || fn == nil {
		return Migration{} // refused by NewOrchestrator, naming it
	}
	return Migration{from: from, to: to, place: func(raw []byte, at Position) ([]byte, Position, error) {
		var old Old
		if err := json.Unmarshal(raw, &old); err != nil {
			return nil, at, fmt.Errorf("decoding its data into %T: %w", old, err)
		}
		nw, pos, err := fn(old, at)
		if err != nil {
			return nil, pos, err
		}
		b, err := json.Marshal(nw)
		if err != nil {
			return nil, pos, fmt.Errorf("marshalling the new data %T: %w", nw, err)
		}
		return b, pos, nil
	}}
}

// MigrationPlan is what a migration does, or would do, with one instance.
type MigrationPlan struct {
	SagaID string
	State  State
	// FromVersion and FromStep: where the instance stands now ("" step:
	// none).
	FromVersion int
	FromStep    string
	// ToVersion and ToStep: where it lands; 0 and "" when it stays.
	ToVersion int
	ToStep    string
	// Next says what the instance does next once placed.
	Next string
	// Stays says why the instance stays on its version; "" when it moves.
	Stays string
}

// Moves reports whether the plan moves the instance.
func (p MigrationPlan) Moves() bool { return p.Stays == "" }

// MigrationReport is what Orchestrator.Migrate did.
type MigrationReport struct {
	// Plans has one entry per live instance of a migrated version, in the
	// order PlanMigration lists them: what was done (an instance that
	// moved on between the plan and its lock stays, and says so).
	Plans []MigrationPlan
	// Moved and Stayed count them.
	Moved, Stayed int
}

// placed is a plan with the instance it writes.
type placed struct {
	plan MigrationPlan
	row  storage.SagaInstance
}

// planOne plans migration m for instance in (a live instance of m.from).
func (o *Orchestrator[D]) planOne(m Migration, in instance) (out placed) {
	from, to := m.from.shape(), m.to.shape()
	p := MigrationPlan{SagaID: in.id, State: in.state, FromVersion: in.defVersion}
	if in.step >= 0 && in.step < len(from) {
		p.FromStep = from[in.step].name
	}
	out.plan = p
	stay := func(format string, args ...any) placed {
		out.plan.Stays = fmt.Sprintf(format, args...)
		return out
	}
	if _, err := o.vs.decider(in); err != nil {
		return stay("%v", err)
	}
	switch {
	case in.state == StateCompensating:
		return stay("compensating (step %q): a migration places only instances running forward; it ends on version %d", p.FromStep, in.defVersion)
	case in.state == StateStuck:
		return stay("stuck: resolve it first (`millwright saga resolve %s`); it stays on version %d", in.id, in.defVersion)
	case in.state != StateRunning || !in.awaiting || p.FromStep == "":
		return stay("not waiting for a step's reply (%s)", in.state)
	}
	data, pos, err := func() (b []byte, pos Position, err error) {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("the migration function panicked: %v", r)
			}
		}()
		return m.place(in.data, Position{Step: p.FromStep})
	}()
	if err != nil {
		return stay("the migration refused it: %v", err)
	}
	ti := -1
	for i, s := range to {
		if s.name == pos.Step {
			ti = i
		}
	}
	fs := from[in.step]
	switch {
	case ti < 0:
		return stay("the migration placed it at step %q, which version %d does not have", pos.Step, m.to.Version())
	case pos.Step != fs.name:
		return stay("the command of step %q is in flight and its reply names that step: a migration keeps an instance at the step it waits on; place it at %q, or migrate it after that reply", fs.name, fs.name)
	case to[ti].success != fs.success || to[ti].failure != fs.failure:
		return stay("step %q's reply types differ in version %d (%q/%q, not %q/%q): the reply in flight would not match", fs.name, m.to.Version(), to[ti].success, to[ti].failure, fs.success, fs.failure)
	case to[ti].compensation != fs.compensation:
		return stay("step %q has a compensation in one version and not in the other: a timeout of its command in flight would be handled differently", fs.name)
	case to[ti].kind != fs.kind:
		return stay("step %q is a %s step in version %d and a %s step in version %d: the instance waits on it as the first", fs.name, fs.kind, in.defVersion, to[ti].kind, m.to.Version())
	case fs.group != "":
		return stay("it runs parallel group %q (its branches answer on their own): migrate it once the group is done", fs.group)
	case to[ti].group != "":
		return stay("version %d has step %q in parallel group %q, whose other branches never ran for this instance: place it at a step outside a group", m.to.Version(), fs.name, to[ti].group)
	}
	ran := map[string]bool{}
	for _, s := range from[:in.step] {
		ran[s.name] = true
	}
	before := map[string]bool{}
	for _, s := range to[:ti] {
		before[s.name] = true
		if s.compensation && !ran[s.name] {
			return stay("step %q comes before %q in version %d and has a compensation, but never ran for this instance: a later failure would send its compensation", s.name, pos.Step, m.to.Version())
		}
	}
	for _, s := range from[:in.step] {
		if s.compensation && !before[s.name] {
			return stay("step %q ran and has a compensation, but version %d has no step %q before %q: a later failure would leave its effect undone", s.name, m.to.Version(), s.name, pos.Step)
		}
	}
	if err := storage.CheckJSONB(data); err != nil {
		return stay("its new data cannot be stored: %v", err)
	}
	out.plan.ToVersion, out.plan.ToStep = m.to.Version(), pos.Step
	out.plan.Next = fmt.Sprintf("sends nothing now; waits for the reply to step %q's command already sent, then ", pos.Step)
	if ti+1 < len(to) {
		out.plan.Next += fmt.Sprintf("sends step %q's command (version %d)", to[ti+1].name, m.to.Version())
	} else {
		out.plan.Next += "completes"
	}
	// The new version's group branches before the position ran (the
	// checks above): their entries say so, so that a later failure
	// compensates them as it would an instance that ran the group.
	branches := maps.Clone(in.branches)
	for _, s := range to[:ti] {
		if s.group != "" {
			if branches == nil {
				branches = map[string]BranchInfo{}
			}
			branches[s.name] = BranchInfo{State: BranchSucceeded}
		}
	}
	row := in.row()
	row.Branches = marshalBranches(branches)
	row.DefVersion, row.DefFingerprint = m.to.Version(), sql.NullString{String: m.to.Fingerprint(), Valid: true}
	row.Data, row.Step = data, ti
	out.row = row
	return out
}

// PlanMigration is the dry run of Config.Migrations over the live
// instances of each migrated version, oldest first: per instance, where
// it stands, where it would land and what it would do next, or why it
// stays on its version. It writes nothing. Orchestrator.Migrate applies
// the same plan.
func (o *Orchestrator[D]) PlanMigration(ctx context.Context) ([]MigrationPlan, error) {
	var out []MigrationPlan
	for _, m := range o.vs.migs {
		rows, err := storage.LiveSagasOfVersion(ctx, o.pool, o.def.name, m.from.Version())
		if err != nil {
			return nil, fmt.Errorf("saga %s: reading the instances of version %d%s: %w", o.def.name, m.from.Version(), storage.Hint(err), err)
		}
		for _, r := range rows {
			out = append(out, o.planOne(m, fromRow(r)).plan)
		}
	}
	return out, nil
}

// Migrate applies Config.Migrations as PlanMigration shows them (it is
// PlanMigration then ApplyMigration): each
// instance the plan moves is locked in a transaction of its own,
// planned again under the lock (an instance that moved on since the plan
// stays, and the report says so: run the migration again), then moved,
// with a "migrated" history row and an audit row by operator
// (audit.RecordTx, command "saga migrate") in that transaction. An
// instance the plan does not move is left as it is. It needs the audit
// table (audit.Migrations). A database error stops it; the instances
// moved so far stay moved and are in the report.
func (o *Orchestrator[D]) Migrate(ctx context.Context, operator audit.Operator) (MigrationReport, error) {
	if err := o.migrationReady(ctx, operator); err != nil {
		return MigrationReport{}, err
	}
	plans, err := o.PlanMigration(ctx)
	if err != nil {
		return MigrationReport{}, err
	}
	return o.ApplyMigration(ctx, operator, plans)
}

func (o *Orchestrator[D]) migrationReady(ctx context.Context, operator audit.Operator) error {
	if err := operator.Valid(); err != nil {
		return fmt.Errorf("saga %s: Migrate: %w", o.def.name, err)
	}
	if err := audit.Ready(ctx, o.db); err != nil {
		return fmt.Errorf("saga %s: Migrate: %w", o.def.name, err)
	}
	return nil
}

// ApplyMigration is Migrate applying plans, a dry run an operator
// reviewed (PlanMigration's): exactly the instances it moves, each only
// if planning it again under its lock gives the same entry (else it
// stays, and its entry in the report says it moved on). An entry of a
// version no migration of the orchestrator starts from is an error,
// before anything is written.
func (o *Orchestrator[D]) ApplyMigration(ctx context.Context, operator audit.Operator, plans []MigrationPlan) (MigrationReport, error) {
	var rep MigrationReport
	if err := o.migrationReady(ctx, operator); err != nil {
		return rep, err
	}
	migs := map[int]Migration{}
	for _, m := range o.vs.migs {
		migs[m.from.Version()] = m
	}
	for _, p := range plans {
		if _, ok := migs[p.FromVersion]; p.Moves() && !ok {
			return rep, fmt.Errorf("saga %s: ApplyMigration: saga %q's plan is from version %d, which no migration in Config.Migrations starts from", o.def.name, p.SagaID, p.FromVersion)
		}
	}
	for _, p := range plans {
		var err error
		if p.Moves() {
			if p, err = o.migrateOne(ctx, migs[p.FromVersion], p, operator); err != nil {
				return rep, err
			}
		}
		rep.Plans = append(rep.Plans, p)
		if p.Moves() {
			rep.Moved++
		} else {
			rep.Stayed++
		}
	}
	return rep, nil
}

// errMovedOn rolls back a migration whose instance moved on since the plan.
var errMovedOn = errors.New("moved on since the plan")

// migrateOne moves one instance as plan says, in a transaction of its own.
func (o *Orchestrator[D]) migrateOne(ctx context.Context, m Migration, plan MigrationPlan, operator audit.Operator) (MigrationPlan, error) {
	var got MigrationPlan
	err := o.db.InTx(ctx, func(tx postgres.Tx) error {
		q, err := storage.FromTx(tx)
		if err != nil {
			return err
		}
		r, err := storage.LockSaga(ctx, q, plan.SagaID)
		if storage.IsNoRows(err) {
			got = plan
			got.ToVersion, got.ToStep, got.Next = 0, "", ""
			got.Stays = "deleted since the plan"
			return errMovedOn
		}
		if err != nil {
			return fmt.Errorf("locking: %w", err)
		}
		in := fromRow(r)
		pl := placed{plan: plan}
		if in.defVersion == m.from.Version() {
			pl = o.planOne(m, in)
		}
		if in.defVersion != m.from.Version() || pl.plan != plan {
			got = plan
			got.ToVersion, got.ToStep, got.Next = 0, "", ""
			got.Stays = fmt.Sprintf("it moved on since the plan (now %s, version %d, step index %d): run the migration again", in.state, in.defVersion, in.step)
			return errMovedOn
		}
		got = pl.plan
		detail := fmt.Sprintf("version %d step %q -> version %d step %q", plan.FromVersion, plan.FromStep, plan.ToVersion, plan.ToStep)
		if err := storage.MigrateSaga(ctx, q, pl.row, in.version, []storage.SagaStep{{Step: plan.ToStep, Kind: KindMigrated, Detail: detail}}); err != nil {
			return fmt.Errorf("writing: %w", err)
		}
		args := []string{plan.SagaID, "--type=" + o.def.name, "--from=" + strconv.Itoa(plan.FromVersion), "--to=" + strconv.Itoa(plan.ToVersion), "--step=" + plan.ToStep}
		if _, err := audit.RecordTx(ctx, tx, operator.Entry("saga migrate", args, 1)); err != nil {
			return err
		}
		return nil
	})
	if errors.Is(err, errMovedOn) {
		return got, nil
	}
	if err != nil {
		return plan, fmt.Errorf("saga %s %q: migrating to version %d: %w", o.def.name, plan.SagaID, plan.ToVersion, err)
	}
	return got, nil
}
