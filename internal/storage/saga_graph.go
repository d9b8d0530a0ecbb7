package storage

import "context"

// SagaInstanceGraph returns the step graph recorded for the definition
// saga id runs on: the row of its (type, def_version, def_fingerprint),
// or for an instance from before fingerprints the version's row seen
// last. ok is false when no row is recorded (the version's orchestrator
// has not run since versions were introduced, or there is no such saga).
func SagaInstanceGraph(ctx context.Context, q Querier, id string) (graph string, ok bool, err error) {
	err = q.Query(ctx, S(`SELECT d.graph FROM millwright_saga_instances i
		JOIN millwright_saga_definitions d ON d.type = i.type AND d.version = i.def_version
			AND (i.def_fingerprint IS NULL OR d.fingerprint = i.def_fingerprint)
		WHERE i.id = $1 ORDER BY d.last_seen_at DESC LIMIT 1`, id), func(r Row) error {
		ok = true
		return r.Scan(&graph)
	})
	return graph, ok, err
}
