package storage

import (
	"context"
	"time"
)

// The saga definitions' versions (saga/versions.go, saga/migrate.go):
// which versions and fingerprints the instances run on, the definitions
// table, and the migration of one instance to another version.

// sagaLive is the SQL condition of an instance that is not finished.
const sagaLive = `state NOT IN ('completed', 'compensated')`

// SagaFingerprintCount is how many live instances of one version run on
// one fingerprint.
type SagaFingerprintCount struct {
	Fingerprint string
	Count       int64
}

// OtherSagaFingerprints returns the fingerprints, other than fp, that
// live instances (not completed nor compensated) of type typ and
// definition version run on, with their counts. Instances without a
// fingerprint (from before versions) are not counted.
func OtherSagaFingerprints(ctx context.Context, q Querier, typ string, version int, fp string) ([]SagaFingerprintCount, error) {
	var out []SagaFingerprintCount
	err := q.Query(ctx, S(`SELECT def_fingerprint, count(*) FROM millwright_saga_instances
		WHERE type = $1 AND def_version = $2 AND `+sagaLive+` AND def_fingerprint IS NOT NULL AND def_fingerprint <> $3
		GROUP BY def_fingerprint ORDER BY count(*) DESC`, typ, version, fp), func(r Row) error {
		var c SagaFingerprintCount
		err := r.Scan(&c.Fingerprint, &c.Count)
		out = append(out, c)
		return err
	})
	return out, err
}

// SagaVersionCount is how many live instances of type run on a version.
type SagaVersionCount struct {
	Version int
	Count   int64
}

// OtherSagaVersions returns the definition versions, other than those in
// versions, that live instances of type typ run on, with their counts.
func OtherSagaVersions(ctx context.Context, q Querier, typ string, versions []int64) ([]SagaVersionCount, error) {
	var out []SagaVersionCount
	err := q.Query(ctx, S(`SELECT def_version, count(*) FROM millwright_saga_instances
		WHERE type = $1 AND `+sagaLive+` AND def_version <> ALL($2::int[])
		GROUP BY def_version ORDER BY def_version`, typ, versions), func(r Row) error {
		var c SagaVersionCount
		err := r.Scan(&c.Version, &c.Count)
		out = append(out, c)
		return err
	})
	return out, err
}

// SagaDefinitionGraph returns the graph recorded for (typ, version, fp);
// ok is false when none is.
func SagaDefinitionGraph(ctx context.Context, q Querier, typ string, version int, fp string) (graph string, ok bool, err error) {
	err = q.Query(ctx, S(`SELECT graph FROM millwright_saga_definitions WHERE type = $1 AND version = $2 AND fingerprint = $3`,
		typ, version, fp), func(r Row) error {
		ok = true
		return r.Scan(&graph)
	})
	return graph, ok, err
}

// RegisterSagaDefinition records that (typ, version, fp) with graph runs
// now: inserted the first time, its last_seen_at moved on after.
func RegisterSagaDefinition(ctx context.Context, q Querier, typ string, version int, fp, graph string) error {
	_, err := q.Exec(ctx, Statement{SQL: `INSERT INTO millwright_saga_definitions (type, version, fingerprint, graph)
		VALUES ($1, $2, $3, $4) ON CONFLICT (type, version, fingerprint) DO UPDATE SET last_seen_at = now()`,
		Args: []any{typ, version, fp, graph}, Expect: NoExpect, What: "registering saga definition " + typ})
	return err
}

// ClaimDueSagaVersions is ClaimDueSagas restricted to instances running
// on one of versions: an instance of a version the orchestrator does not
// run is left alone (and does not take a place in the batch).
//
// versions[i]'s fingerprint is fps[i]: an instance of that version that
// started on another fingerprint is left alone too (instances without a
// fingerprint, from before versions, are claimed).
func ClaimDueSagaVersions(ctx context.Context, q Querier, typ string, versions []int64, fps []string, limit int) ([]SagaInstance, error) {
	var out []SagaInstance
	err := q.Query(ctx, S(`SELECT `+sagaInstanceColumns+` FROM millwright_saga_instances
		WHERE type = $1 AND deadline_at <= now() AND EXISTS (SELECT 1 FROM unnest($3::int[], $4::text[]) AS r(v, f)
			WHERE r.v = def_version AND (def_fingerprint IS NULL OR def_fingerprint = r.f))
		ORDER BY deadline_at LIMIT $2 FOR UPDATE SKIP LOCKED`, typ, limit, versions, fps), func(r Row) error {
		var in SagaInstance
		err := r.Scan(in.dest()...)
		out = append(out, in)
		return err
	})
	return out, err
}

// LiveSagasOfVersion returns the live instances of type typ on definition
// version, oldest first, unlocked (a dry run reads; a migration locks
// each with LockSaga).
func LiveSagasOfVersion(ctx context.Context, q Querier, typ string, version int) ([]SagaInstance, error) {
	var out []SagaInstance
	err := q.Query(ctx, S(`SELECT `+sagaInstanceColumns+` FROM millwright_saga_instances
		WHERE type = $1 AND def_version = $2 AND `+sagaLive+` ORDER BY created_at, id`, typ, version), func(r Row) error {
		var in SagaInstance
		err := r.Scan(in.dest()...)
		out = append(out, in)
		return err
	})
	return out, err
}

// MigrateSaga moves instance in (locked, read at version old) to the
// definition version in.DefVersion with in.DefFingerprint, its data and
// current step set from in, and appends the history rows: one batch. A row
// no longer at old fails with a *ConflictError.
func MigrateSaga(ctx context.Context, q Querier, in SagaInstance, old int64, steps []SagaStep) error {
	if err := CheckJSONB(in.Data); err != nil {
		return err
	}
	ss := []Statement{{SQL: `UPDATE millwright_saga_instances SET def_version = $3, def_fingerprint = $4, data = $5::jsonb,
		current_step = $6, branches = $7::jsonb, version = version + 1, updated_at = now() WHERE id = $1 AND version = $2`,
		Args: []any{in.ID, old, in.DefVersion, sagaNullString(in.DefFingerprint), string(in.Data), in.Step, sagaNullJSON(in.Branches)}, Expect: 1,
		What: "migrating saga instance " + in.ID}}
	if len(steps) > 0 {
		ss = append(ss, SagaSteps(in.ID, steps))
	}
	return q.Batch(ctx, ss...)
}

// SagaVersionRow counts the instances of one type, definition version and
// state.
type SagaVersionRow struct {
	Type    string
	Version int
	State   string
	Count   int64
}

// SagaVersionStates counts the instances by type, definition version and
// state.
func SagaVersionStates(ctx context.Context, q Querier) ([]SagaVersionRow, error) {
	var out []SagaVersionRow
	err := q.Query(ctx, S(`SELECT type, def_version, state, count(*) FROM millwright_saga_instances
		GROUP BY 1, 2, 3 ORDER BY 1, 2, 3`), func(r Row) error {
		var v SagaVersionRow
		err := r.Scan(&v.Type, &v.Version, &v.State, &v.Count)
		out = append(out, v)
		return err
	})
	return out, err
}

// SagaDefinitionRow is a row of millwright_saga_definitions.
type SagaDefinitionRow struct {
	Type                     string
	Version                  int
	Fingerprint, Graph       string
	RegisteredAt, LastSeenAt time.Time
}

// SagaDefinitions returns the registered definitions by type, version,
// first registered first.
func SagaDefinitions(ctx context.Context, q Querier) ([]SagaDefinitionRow, error) {
	var out []SagaDefinitionRow
	err := q.Query(ctx, S(`SELECT type, version, fingerprint, graph, registered_at, last_seen_at FROM millwright_saga_definitions
		ORDER BY type, version, registered_at`), func(r Row) error {
		var d SagaDefinitionRow
		err := r.Scan(&d.Type, &d.Version, &d.Fingerprint, &d.Graph, &d.RegisteredAt, &d.LastSeenAt)
		out = append(out, d)
		return err
	})
	return out, err
}
