package console_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/postgres"
)

// Three dead letters of one Go type (errors.New's), two of one cause
// differing only in numbers and one of another: the first page lists two
// causes, the first counting two; its link lists those two.
func TestDeadLettersFirstPageGroupsByCause(t *testing.T) {
	t.Parallel()
	b := setup(t)
	db := postgres.From(b.schema.DB)
	now := time.Now().UTC()
	var ids []int64
	for i, err := range []error{errors.New("charging order 1841: card declined after 3 attempts"),
		errors.New("charging order 7: card declined after 12 attempts"), errors.New("ledger unavailable")} {
		require.NoError(t, db.InTx(context.Background(), func(tx postgres.Tx) error {
			id, e := dlq.RecordTx(context.Background(), tx, dlq.DeadLetter{MessageUUID: fmt.Sprintf("m%d", i), OriginalTopic: "payments",
				Handler: "charge", Reason: dlq.ReasonExhausted, Error: err.Error(), ErrorType: fmt.Sprintf("%T", err), Attempts: 3,
				LastFailure: now.Add(time.Duration(i) * time.Second)})
			ids = append(ids, id)
			return e
		}))
	}
	status, body := b.get(t, "/dead-letters")
	require.Equal(t, http.StatusOK, status, body)
	rows := regexp.MustCompile(`<tr class="cause" data-fingerprint="([0-9a-f]+)">`).FindAllStringSubmatch(body, -1)
	require.Len(t, rows, 2, "two causes on the first page")
	require.Contains(t, body, "charging order &lt;n&gt;: card declined after &lt;n&gt; attempts")
	counts := regexp.MustCompile(`<td class="cause-count">(\d+)</td>`).FindAllStringSubmatch(body, -1)
	require.Equal(t, "2", counts[0][1])
	require.Equal(t, "1", counts[1][1])

	status, body = b.get(t, "/dead-letters?cause="+rows[0][1])
	require.Equal(t, http.StatusOK, status, body)
	listed := regexp.MustCompile(`<tr class="letter" data-id="(\d+)">`).FindAllStringSubmatch(body, -1)
	var got []string
	for _, m := range listed {
		got = append(got, m[1])
	}
	require.Equal(t, []string{fmt.Sprint(ids[0]), fmt.Sprint(ids[1])}, got)
	require.True(t, strings.Contains(body, `id="filter-active"`))
}
