// Package batch holds the error type shared by the transports' batch
// publishers; package transport re-exports it as transport.BatchError.
package batch

import (
	"fmt"
	"sort"
)

// Error reports which messages of a batch publish were not published.
// Messages whose index is not in Failed were accepted by the broker.
type Error struct {
	// Failed maps the index of each unpublished message to its error.
	Failed map[int]error
}

func (e *Error) Error() string {
	idx := make([]int, 0, len(e.Failed))
	for i := range e.Failed {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	if len(idx) == 0 {
		return "batch publish failed"
	}
	return fmt.Sprintf("batch publish: %d message(s) not published, first (index %d): %v", len(idx), idx[0], e.Failed[idx[0]])
}

// Unwrap returns the errors of the failed messages.
func (e *Error) Unwrap() []error {
	out := make([]error, 0, len(e.Failed))
	for _, err := range e.Failed {
		out = append(out, err)
	}
	return out
}
