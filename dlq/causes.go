package dlq

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/millwright/millwright/internal/fingerprint"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// NormalizeError returns an error message with what varies between two
// occurrences of one cause replaced: numbers (<n>), UUIDs (<uuid>), hex
// ids and words of 8 or more hex digits with a digit and a letter (<hex>),
// durations (<duration>), quoted values ("<value>", '<value>',
// `<value>`); spaces collapsed; cut to 1 KiB. It never fails, and
// NormalizeError(NormalizeError(s)) == NormalizeError(s).
func NormalizeError(msg string) string { return fingerprint.Normalize(msg) }

// Fingerprint returns the fingerprint of a failure, what dead letters are
// grouped by (Causes): 16 hex digits of the SHA-256 of the handler, the
// error's Go type and NormalizeError of its message. RecordTx stores it
// with each dead letter (DeadLetter.Fingerprint).
func Fingerprint(handler, errorType, msg string) string {
	return fingerprint.Of(handler, errorType, msg)
}

// Cause is the dead letters of one failure's cause: one fingerprint.
type Cause struct {
	Fingerprint string
	// Handler and ErrorType are the fingerprint's; Pattern is its
	// normalised message (NormalizeError).
	Handler, ErrorType, Pattern string
	// Count counts the rows; Dead those still dead.
	Count, Dead int64
	// FirstSeen and LastSeen bound their failures.
	FirstSeen, LastSeen time.Time
	// Topics are their original topics, sorted.
	Topics []string
	// SampleID, SampleUUID and SampleError are the newest row's.
	SampleID                int64
	SampleUUID, SampleError string
}

// Causes returns the dead letters f selects (its Topic, Since, Until,
// ErrorType, ErrorContains and Pending) grouped by fingerprint, the
// largest group first: the console's first page and `millwright dlq
// groups`, on db or in the caller's transaction. A row recorded before
// dlq migration 006 has no stored fingerprint; its own is computed here.
func Causes(ctx context.Context, db postgres.Handle, f Filter) ([]Cause, error) {
	q, err := storage.FromHandle(db)
	if err != nil {
		return nil, fmt.Errorf("dlq: Causes: %w", err)
	}
	return causes(ctx, q, f)
}

// Causes is the package's Causes on the Store's pool.
func (s *Store) Causes(ctx context.Context, f Filter) ([]Cause, error) {
	if s.err != nil {
		return nil, s.err
	}
	return causes(ctx, s.pool, f)
}

func causes(ctx context.Context, q storage.Querier, f Filter) ([]Cause, error) {
	sel, err := resolveSelection(ctx, q, f)
	if err != nil {
		return nil, err
	}
	rows, err := storage.GroupDeadLetterCauses(ctx, q, sel)
	if err != nil {
		return nil, fmt.Errorf("dlq: grouping dead letters by cause%s: %w", storage.Hint(err), err)
	}
	at := map[string]int{}
	var out []Cause
	for _, r := range rows {
		fp := r.Fingerprint
		if r.Legacy {
			fp = Fingerprint(r.Handler, r.ErrorType, r.Error)
		}
		i, ok := at[fp]
		if !ok {
			at[fp] = len(out)
			out = append(out, Cause{Fingerprint: fp, Handler: r.Handler, ErrorType: r.ErrorType, Pattern: NormalizeError(r.SampleError),
				Count: r.Count, Dead: r.Dead, FirstSeen: r.FirstSeen, LastSeen: r.LastSeen, Topics: r.Topics,
				SampleID: r.SampleID, SampleUUID: r.SampleUUID, SampleError: r.SampleError})
			continue
		}
		c := &out[i]
		c.Count += r.Count
		c.Dead += r.Dead
		if r.FirstSeen.Before(c.FirstSeen) {
			c.FirstSeen = r.FirstSeen
		}
		if r.LastSeen.After(c.LastSeen) {
			c.LastSeen = r.LastSeen
		}
		if r.SampleID > c.SampleID {
			c.SampleID, c.SampleUUID, c.SampleError, c.Pattern = r.SampleID, r.SampleUUID, r.SampleError, NormalizeError(r.SampleError)
		}
		for _, t := range r.Topics {
			if !slices.Contains(c.Topics, t) {
				c.Topics = append(c.Topics, t)
			}
		}
		slices.Sort(c.Topics)
	}
	slices.SortStableFunc(out, func(a, b Cause) int {
		if c := cmp.Compare(b.Count, a.Count); c != 0 {
			return c
		}
		return b.LastSeen.Compare(a.LastSeen)
	})
	return out, nil
}

// resolveSelection is f's selection with, for a filter by fingerprint,
// the causes of the rows without a stored one that have it.
func resolveSelection(ctx context.Context, q storage.Querier, f Filter) (storage.DeadLetterFilter, error) {
	sel := f.selection()
	if f.Fingerprint == "" {
		return sel, nil
	}
	old, err := storage.UnfingerprintedCauses(ctx, q)
	if err != nil {
		return sel, fmt.Errorf("dlq: reading the dead letters recorded before their fingerprints%s: %w", storage.Hint(err), err)
	}
	for _, c := range old {
		if Fingerprint(c.Handler, c.ErrorType, c.Error) == f.Fingerprint {
			sel.Unfingerprinted = append(sel.Unfingerprinted, c)
		}
	}
	return sel, nil
}
