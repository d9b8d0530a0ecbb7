package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// Three dead letters of one Go type, two causes differing only in numbers
// and one other: `dlq groups --json` prints two causes, the table too.
func TestDLQGroupsByCause(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, dlq.Migrations())
	db := postgres.From(s.DB)
	now := time.Now().UTC()
	for i, err := range []error{errors.New("charging order 1841: card declined after 3 attempts"),
		errors.New("charging order 7: card declined after 12 attempts"), errors.New("ledger unavailable")} {
		require.NoError(t, db.InTx(context.Background(), func(tx postgres.Tx) error {
			_, e := dlq.RecordTx(context.Background(), tx, dlq.DeadLetter{MessageUUID: fmt.Sprintf("m%d", i), OriginalTopic: "payments",
				Handler: "charge", Reason: dlq.ReasonExhausted, Error: err.Error(), ErrorType: fmt.Sprintf("%T", err), Attempts: 3,
				LastFailure: now.Add(time.Duration(i) * time.Second)})
			return e
		}))
	}
	out, err := runDLQ(t, s.URL, "groups", "--json")
	require.NoError(t, err, out)
	var causes []causeRow
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		var c causeRow
		require.NoError(t, json.Unmarshal([]byte(line), &c), line)
		causes = append(causes, c)
	}
	require.Len(t, causes, 2, out)
	require.EqualValues(t, 2, causes[0].Count)
	require.Equal(t, "charging order <n>: card declined after <n> attempts", causes[0].Pattern)
	require.Equal(t, "*errors.errorString", causes[0].ErrorType)
	require.Equal(t, []string{"payments"}, causes[0].Topics)
	require.Equal(t, "m1", causes[0].SampleUUID)
	require.EqualValues(t, 1, causes[1].Count)
	require.Equal(t, "ledger unavailable", causes[1].Pattern)

	out, err = runDLQ(t, s.URL, "groups")
	require.NoError(t, err, out)
	require.Contains(t, out, "FINGERPRINT")
	require.Contains(t, out, causes[0].Fingerprint)
	require.Contains(t, out, causes[1].Fingerprint)
}
