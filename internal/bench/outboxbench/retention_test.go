package outboxbench

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/outbox"
)

// TestRetentionSection runs the retention section small and checks what
// it reports, not how fast: every row is there, the DELETE leaves one dead
// tuple per row and keeps the space, dropping partitions leaves no dead
// tuple and returns it.
func TestRetentionSection(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	var out bytes.Buffer
	err := Run(context.Background(), Config{DB: s.DB, URL: s.URL, Rounds: 1, PublishedRows: 50000,
		Sections: []string{SectionRetention}, Out: &out, JSON: true})
	require.NoError(t, err)
	rows := map[string]Row{}
	dec := json.NewDecoder(&out)
	for dec.More() {
		var r Row
		require.NoError(t, dec.Decode(&r))
		require.Equal(t, "retention", r.Case)
		rows[r.Variant] = r
	}
	find := func(prefix string) Row {
		t.Helper()
		for v, r := range rows {
			if strings.HasPrefix(v, prefix) {
				return r
			}
		}
		t.Fatalf("no row %q in %v", prefix, rows)
		return Row{}
	}
	require.Len(t, rows, 14)
	require.Positive(t, find("remove 50000 published rows: batched DELETE").Value)
	require.Positive(t, find("remove 50000 published rows: detach and drop 10 daily partitions").Value)
	require.Positive(t, find("4 writers' tx/s during the DELETE").Baseline, "writers wrote before")
	require.Positive(t, find("4 writers' tx/s during the partition drop").Value, "writers wrote during")
	require.GreaterOrEqual(t, find("dead tuples left for vacuum after the DELETE").Value, 50000.0)
	require.Zero(t, find("dead tuples left for vacuum after the partition drop").Value)
	require.GreaterOrEqual(t, find("outbox size (table and indexes) after the DELETE").Ratio, 1.0, "a DELETE returns no space")
	// Only the drop returns the removed rows' space. 50,000 rows: at 5,000
	// the writers' rows (two seconds of four writers) and the empty
	// partitions made ahead weighed as much as the removed rows, and a CI
	// run found the partitioned outbox the larger one after.
	require.Less(t, find("outbox size (table and indexes) after the partition drop").Ratio, 0.5, "dropped partitions return their space")
	require.Less(t, find("outbox size (table and indexes) after the partition drop").Value,
		find("outbox size (table and indexes) after the DELETE").Value, "dropped partitions return their space")
}
