package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrations"
)

// freshRoot is the CLI's command tree built anew, so flags set by one run
// do not leak into the next (rootCmd is built once, by init functions).
func freshRoot() *cobra.Command {
	root := &cobra.Command{Use: "millwright", SilenceUsage: true, SilenceErrors: true}
	addSchemaFlag(root)
	root.AddCommand(migrateCmd(), outboxCmd(), dlqCmd(), sagaCmd(), auditCmd(), idempotencyCmd())
	return root
}

// The README's operator commands work right after the orders demo: the
// test runs the demo (its own schema instead of millwright_orders, the
// sql transport), then every `go run ./cmd/millwright` line of the
// README's block, in order, with MILLWRIGHT_SCHEMA as the README exports
// it, and checks that each finds what the demo left.
func TestReadmeCommandsAfterDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the orders demo")
	}
	raw, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	require.NoError(t, err)
	block := regexp.MustCompile("(?s)## Operator CLI.*?```sh\n(.*?)```").FindSubmatch(raw)
	require.NotNil(t, block, "README.md has no sh block under ## Operator CLI")
	var cmds [][]string
	var sawDemo, sawExport bool
	for _, line := range strings.Split(string(block[1]), "\n") {
		line, _, _ = strings.Cut(line, "#")
		f := strings.Fields(line)
		switch {
		case len(f) == 0:
		case strings.Join(f, " ") == "go run ./examples/orders demo":
			sawDemo = true
		case strings.Join(f, " ") == "export "+envSchema+"=millwright_orders":
			sawExport = true
		case len(f) > 2 && f[0] == "go" && f[1] == "run" && f[2] == "./cmd/millwright":
			cmds = append(cmds, f[3:])
		default:
			t.Fatalf("README.md's operator block has a line the test does not know: %q", line)
		}
	}
	require.True(t, sawDemo && sawExport, "the block starts with the demo and exports its schema")
	require.GreaterOrEqual(t, len(cmds), 8)

	schema := pgtest.New(t) // empty: the demo migrates it
	bin := filepath.Join(t.TempDir(), "orders")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "../../examples/orders")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "building the demo: %s", out)
	demo := exec.CommandContext(ctx, bin, "demo", "-database-url", pgtest.BaseURL(), "-schema", schema.Name,
		"-transport", "gochannel", "-orders", "12", "-fail-payment-every", "4", "-fail-shipping-every", "5")
	out, err = demo.CombinedOutput()
	require.NoError(t, err, "the demo: %s", out)
	require.Contains(t, string(out), "dlq=1")

	t.Setenv(envSchema, schema.Name)
	wants := map[string]string{
		"migrate --dry-run": "database is up to date",
		"outbox status":     "(all)  0",
		"dlq list --topic billing.commands --since 24h": "billing.commands",
		"dlq replay --topic billing.commands --dry-run": "billing.commands",
		"saga list --state compensated":                 "compensated",
		"audit list":                                    "outbox retry-failed",
		"migrate":                                       "database is up to date",
		"outbox retry-failed --dry-run":                 "",
	}
	ran := []string{}
	for _, args := range cmds {
		line := strings.Join(args, " ")
		stdout, stderr, err := runCLI(t, freshRoot(), nil, pgtest.BaseURL(), args...)
		require.NoError(t, err, "millwright %s: %s", line, stderr)
		want, ok := wants[line]
		require.True(t, ok, "README command %q has no expectation here: add one", line)
		require.Contains(t, stdout, want, "millwright %s printed:\n%s", line, stdout)
		ran = append(ran, line)
	}
	sort.Strings(ran)
	require.Len(t, ran, len(wants), "every expectation is a README command")
}

// `millwright migrate` applies exactly what migrations.All lists, so an
// application applying migrations.All gets the CLI's tables, the audit
// table included.
func TestMigrateAppliesMigrationsAll(t *testing.T) {
	t.Parallel()
	var cli, all []string
	for _, s := range migrationSources {
		cli = append(cli, s.Component)
	}
	for _, s := range migrations.All() {
		all = append(all, s.Component)
	}
	sort.Strings(cli)
	sort.Strings(all)
	require.Equal(t, all, cli)
}

// migrate creates the schema it is pointed at; every command then works
// in it, by --schema or MILLWRIGHT_SCHEMA; a dry run works without the
// audit table and creates nothing.
func TestSchemaFlagAndMigrateCreatesSchema(t *testing.T) {
	s := pgtest.New(t) // its pool's search_path is s.Name; the new schema is beside it
	name := s.Name + "_new"
	t.Cleanup(func() { _, _ = s.DB.Exec(`DROP SCHEMA IF EXISTS ` + name + ` CASCADE`) })
	exists := func(q string) bool {
		var ok bool
		require.NoError(t, s.DB.QueryRow(q).Scan(&ok))
		return ok
	}
	_, stderr, err := runCLI(t, freshRoot(), nil, pgtest.BaseURL(), "outbox", "retry-failed", "--dry-run", "--schema", s.Name)
	require.Error(t, err, "no outbox table yet") // but not for want of the audit table
	require.NotContains(t, err.Error(), "audit")
	_ = stderr

	out, _, err := runCLI(t, freshRoot(), nil, pgtest.BaseURL(), "migrate", "--dry-run", "--schema", name)
	require.NoError(t, err)
	require.Contains(t, out, "would apply outbox 001_outbox")
	require.False(t, exists(`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = '`+name+`')`), "a dry run creates no schema")

	out, _, err = runCLI(t, freshRoot(), nil, pgtest.BaseURL(), "--schema", name, "migrate")
	require.NoError(t, err)
	require.Contains(t, out, "applied audit 001_audit")
	require.True(t, exists(`SELECT to_regclass('`+name+`.millwright_outbox') IS NOT NULL AND to_regclass('`+name+`.millwright_audit') IS NOT NULL`))

	t.Setenv(envSchema, name)
	out, _, err = runCLI(t, freshRoot(), nil, pgtest.BaseURL(), "saga", "list")
	require.NoError(t, err, "saga list finds its table through MILLWRIGHT_SCHEMA")
	require.Contains(t, out, "no sagas match")

	_, _, err = runCLI(t, freshRoot(), nil, pgtest.BaseURL(), "outbox", "status", "--schema", "x; DROP")
	require.ErrorContains(t, err, "plain Postgres identifier")
}
