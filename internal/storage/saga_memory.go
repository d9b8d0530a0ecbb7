package storage

import "slices"

// SagaFactsOf answers f from rows, a saga's whole step history held in
// memory (saga's simulator), exactly as LoadSagaFacts answers it from
// millwright_saga_steps: keep the two in step.
func SagaFactsOf(rows []SagaStep, f SagaFactsQuery) SagaFacts {
	out := SagaFacts{MaxAttempt: map[string]int{}}
	for _, r := range rows {
		if r.Step == f.AnsweredStep && r.Attempt == f.AnsweredAttempt && slices.Contains(f.AnsweredKinds, r.Kind) {
			out.Answered = true
		}
		if r.Kind == f.FinalKind {
			out.Final = true
		}
		if r.Kind == f.AttemptKind {
			if m, ok := out.MaxAttempt[r.Step]; !ok || r.Attempt > m {
				out.MaxAttempt[r.Step] = r.Attempt
			}
		}
	}
	return out
}

// InsertedSaga returns in as InsertSaga stores it: the columns it writes,
// the others at their defaults (version 1), as a read of the row returns
// them. Saga's simulator keeps its rows so: keep the two in step.
func InsertedSaga(in SagaInstance) SagaInstance {
	return SagaInstance{ID: in.ID, Type: in.Type, State: in.State, Step: in.Step, Data: in.Data, Version: 1,
		Deadline: in.Deadline, Awaiting: in.Awaiting, CreatedAt: in.CreatedAt, Branches: in.Branches,
		DefVersion: in.DefVersion, DefFingerprint: in.DefFingerprint}
}
