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
