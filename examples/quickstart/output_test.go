package main

import (
	"context"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
)

// The quickstart prints the line its doc comment shows (driver=pgx, the
// default), and the same counts on database/sql (-driver pq).
func TestOutputLine(t *testing.T) {
	t.Parallel()
	src, err := os.ReadFile("main.go")
	require.NoError(t, err)
	m := regexp.MustCompile(`(?m)^//\t(driver=pgx transport=sql orders=20 .*)$`).FindSubmatch(src)
	require.NotNil(t, m, "main.go's doc shows no driver=pgx transport=sql output line")
	bin := pgconntest.Build(t, ".")
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		s := pgtest.New(t) // the quickstart migrates it
		args := []string{"-database-url", s.URL}
		if driver != pgtest.DriverPgx {
			args = append(args, "-driver", driver) // pgx is the default
		}
		cmd := exec.CommandContext(ctx, bin, args...)
		cmd.Env = append(os.Environ(), "MILLWRIGHT_TRANSPORT=", "MILLWRIGHT_DATABASE_DRIVER=")
		out, err := cmd.Output()
		require.NoError(t, err, "quickstart: %s", out)
		want := strings.Replace(string(m[1]), "driver=pgx", "driver="+driver, 1)
		require.Equal(t, want+"\n", string(out))
	})
}

// A new application selects every kind by environment alone, the
// development fakes included: the quickstart runs to the same counts with
// MILLWRIGHT_TRANSPORT set to each of them.
func TestSelectedByEnvironmentAlone(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, ".")
	for _, sel := range []string{"gochannel", "mem://", "kfake", "kfake://", "pstest", "pstest://quickstart-env"} {
		t.Run(sel, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			s := pgtest.New(t)
			cmd := exec.CommandContext(ctx, bin, "-database-url", s.URL, "-orders", "5")
			cmd.Env = append(os.Environ(), "MILLWRIGHT_TRANSPORT="+sel, "MILLWRIGHT_DATABASE_DRIVER=")
			out, err := cmd.Output()
			require.NoError(t, err, "quickstart with MILLWRIGHT_TRANSPORT=%s: %s", sel, out)
			require.Regexp(t, `^driver=pgx transport=(gochannel|kafka|googlecloud) orders=5 published=5 effects=5 duplicates_skipped=5 lost=0 duplicate_effects=0\n$`, string(out))
		})
	}
}
