package main

import (
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport"
)

// A demo that gives up (-timeout 1ms: the deadline also cuts WaitSettled's
// first count short) prints the true counts, counted with a fresh
// context, and says "not settled"; before, it printed
// "orders=0 completed=0 ... lost=0" while every order was pending.
//
// Not parallel: the demo selects its transport through the process's
// environment (MILLWRIGHT_TRANSPORT, which TestDemo sets too), so each
// run has it to itself and t.Setenv restores it.
func TestDemoGivesUpWithTrueCounts(t *testing.T) {
	line := regexp.MustCompile(`^not settled after 1ms: orders=12 completed=\d+ compensated=\d+ dlq=\d+ pending=(\d+) unnotified_events=\d+ duplicate_effects=0\n$`)
	for _, kind := range []string{"gochannel", "sql"} {
		t.Run(kind, func(t *testing.T) {
			t.Setenv(transport.EnvTransport, "")
			t.Setenv(transport.EnvSQLURL, "")
			schema := pgtest.New(t) // migrations are applied by the demo itself
			args := []string{"-database-url", pgtest.BaseURL(), "-schema", schema.Name, "-orders", "12", "-timeout", "1ms"}
			if kind != "sql" { // the default: sql on the database
				args = append(args, "-transport", kind)
			}
			var out strings.Builder
			err := demo(args, &out)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.ErrorContains(t, err, "orders not settled after 1ms: ")
			t.Logf("%s%v", out.String(), err)
			m := line.FindStringSubmatch(out.String())
			require.NotNil(t, m, "summary line: %q", out.String())
			require.Contains(t, err.Error(), " of 12 pending")
			if kind == "sql" && m[1] != "0" {
				require.ErrorContains(t, err, "docs/runbooks.md#millwrightsqlhorizonheld")
			}
		})
	}
}
