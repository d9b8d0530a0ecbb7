package saga

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/outbox"
)

// The literals the hot statements carry read back as the values they
// render, quotes, backslashes and non-ASCII text included.
func TestLiteralsRoundTrip(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	ctx := context.Background()
	for _, v := range []string{"", "o-1", `it's "quoted"`, `back\slash \n`, "é中\u2028", "'; DROP TABLE x; --"} {
		var got string
		require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT `+litText(v)).Scan(&got))
		require.Equal(t, v, got)
	}
	at := time.Date(2026, 12, 1, 4, 5, 6, 123456789, time.FixedZone("x", 5*3600+1800))
	var gotT time.Time
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT `+litTime(at)).Scan(&gotT))
	require.True(t, at.Round(time.Microsecond).Equal(gotT), "%s != %s", at, gotT) // Postgres rounds, as with parameters
	var null sql.NullString
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT `+litNullTime(sql.NullTime{})+`::text`).Scan(&null))
	require.False(t, null.Valid)

	tr := &transition{}
	tr.record("reserve", KindReply, `a'b`, 2, "")
	tr.record("charge", KindCompensation, "", 3, `err \ "x"`)
	var steps, kinds, errs []sql.NullString
	rows, err := s.DB.QueryContext(ctx, `WITH h AS (SELECT * FROM unnest(`+
		litArray(2, "text[]", func(i int) string { return litText(tr.hist[i].detail) })+`, `+
		litArray(2, "text[]", func(i int) string { return litText(tr.hist[i].kind) })+`, `+
		litArray(2, "text[]", func(i int) string {
			if tr.hist[i].err == "" {
				return "NULL"
			}
			return litText(tr.hist[i].err)
		})+`) WITH ORDINALITY AS u(d, k, e, o)) SELECT d, k, e FROM h ORDER BY o`)
	require.NoError(t, err)
	for rows.Next() {
		var d, k, e sql.NullString
		require.NoError(t, rows.Scan(&d, &k, &e))
		steps, kinds, errs = append(steps, d), append(kinds, k), append(errs, e)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []sql.NullString{{String: `a'b`, Valid: true}, {String: "", Valid: true}}, steps)
	require.Equal(t, []sql.NullString{{String: KindReply, Valid: true}, {String: KindCompensation, Valid: true}}, kinds)
	require.Equal(t, []sql.NullString{{}, {String: `err \ "x"`, Valid: true}}, errs)
	var empty int
	require.NoError(t, s.DB.QueryRowContext(ctx, `SELECT cardinality(`+litArray(0, "int[]", nil)+`)`).Scan(&empty))
	require.Zero(t, empty)
}

// outboxStatement hands over the one statement outbox.Add runs, and
// passes on Add's refusal of an event.
func TestOutboxStatement(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	stmt, ok, err := outboxStatement(ctx, []outbox.Event{{Topic: "t", AggregateID: "a", Payload: []byte(`{}`)}})
	require.NoError(t, err)
	require.True(t, ok)
	require.Contains(t, stmt, "INSERT INTO millwright_outbox")
	_, _, err = outboxStatement(ctx, []outbox.Event{{AggregateID: "a"}})
	require.ErrorIs(t, err, outbox.ErrInvalidEvent)
}
