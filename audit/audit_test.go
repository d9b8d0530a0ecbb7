package audit_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

const secret = "Sup3rS3cretPW"

func TestRedactArgsHidesEverySecretShape(t *testing.T) {
	t.Parallel()
	in := []string{
		"--database-url=postgres://postgres:" + secret + "@127.0.0.1:5432/test?sslmode=disable",
		"--transport=amqp://guest:" + secret + "@127.0.0.1:5672/",
		"kafka://broker:9092?sasl_user=u&sasl_password=" + secret,
		"host=127.0.0.1 user=postgres password=" + secret + " dbname=test",
		"host=127.0.0.1 password='" + secret + " with space' dbname=test",
		"--sasl-password=" + secret,
		"--api-token=" + secret,
		"http://%zz:" + secret + "@host/",
		"--topic=orders",
		"o-1",
	}
	out := audit.RedactArgs(in)
	require.Len(t, out, len(in))
	for i, o := range out {
		require.NotContains(t, o, secret, "arg %d: %q", i, in[i])
	}
	require.Equal(t, "--database-url=postgres://postgres:xxxxx@127.0.0.1:5432/test?sslmode=disable", out[0])
	require.Equal(t, "--topic=orders", out[8])
	require.Equal(t, "o-1", out[9])
	require.Contains(t, in[0], secret, "input not modified")
}

func TestRecordAndList(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, audit.Migrations())
	s.DB.SetMaxOpenConns(2)
	ctx := context.Background()
	require.NoError(t, audit.Ready(ctx, postgres.SQL(s.DB)))

	id, err := audit.Record(ctx, postgres.SQL(s.DB), audit.Entry{
		User: audit.CurrentUser(), Host: audit.Hostname(), Command: "millwright dlq replay",
		Args: []string{"--all"}, Confirmed: "--yes", Affected: 3,
	})
	require.NoError(t, err)
	_, err = audit.Record(ctx, postgres.SQL(s.DB), audit.Entry{Command: "millwright saga resolve", DryRun: true, Confirmed: "dry-run", Error: "saga x: not found"})
	require.NoError(t, err)
	_, err = audit.Record(ctx, postgres.SQL(s.DB), audit.Entry{})
	require.ErrorContains(t, err, "Entry.Command is empty")

	got, err := audit.List(ctx, postgres.SQL(s.DB), 0)
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.Equal(t, "millwright saga resolve", got[0].Command)
	require.True(t, got[0].DryRun)
	require.Equal(t, "saga x: not found", got[0].Error)
	require.Equal(t, []string{}, got[0].Args)
	require.Equal(t, id, got[1].ID)
	require.Equal(t, []string{"--all"}, got[1].Args)
	require.EqualValues(t, 3, got[1].Affected)
	require.NotEmpty(t, got[1].User)
	require.False(t, got[1].At.IsZero())
}

func TestMissingTableNamesTheFix(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t)
	s.DB.SetMaxOpenConns(1)
	ctx := context.Background()
	require.ErrorIs(t, audit.Ready(ctx, postgres.SQL(s.DB)), audit.ErrNotMigrated)
	_, err := audit.Record(ctx, postgres.SQL(s.DB), audit.Entry{Command: "x"})
	require.ErrorIs(t, err, audit.ErrNotMigrated)
	require.True(t, strings.Contains(err.Error(), "millwright migrate"))
}

func TestRedactValueFindsURLsInsideText(t *testing.T) {
	t.Parallel()
	msg := `connecting to database postgres://u:` + secret + `@h:5432/db?sslmode=disable: dial tcp: refused; also amqp://g:` + secret + `@r/ and password=` + secret
	got := audit.RedactValue(msg)
	require.NotContains(t, got, secret)
	require.Contains(t, got, "postgres://u:xxxxx@h:5432/db?sslmode=disable: dial tcp")
}

// Issue 40 build 4: a binary key passed on the command line (invalid
// UTF-8, a NUL) made the audit row's insert fail after the change it
// records had committed. RedactArgs stores such an argument Go-quoted.
func TestAnArgumentTextCannotHoldIsRecordedQuoted(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, audit.Migrations())
	ctx := context.Background()
	args := audit.RedactArgs([]string{"--key=\x0a\xff\x01", "a\x00b", "plain"})
	_, err := audit.Record(ctx, postgres.SQL(s.DB), audit.Entry{Command: "millwright parked release", Args: args})
	require.NoError(t, err)
	got, err := audit.List(ctx, postgres.SQL(s.DB), 1)
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.Equal(t, []string{`--key="\n\xff\x01"`, `"a\x00b"`, "plain"}, got[0].Args)
}
