package main

import (
	"bytes"
	"context"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/cli/clitest"
)

// runCLI runs root with args, stdin in, and --database-url dbURL on every
// command that takes it; it returns what the command printed.
func runCLI(t *testing.T, root *cobra.Command, in io.Reader, dbURL string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	var out, errOut bytes.Buffer
	if in == nil {
		in = strings.NewReader("")
	}
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetIn(in)
	root.SetArgs(args)
	var setURL func(c *cobra.Command)
	setURL = func(c *cobra.Command) {
		if c.Flags().Lookup("database-url") != nil {
			require.NoError(t, c.Flags().Set("database-url", dbURL))
		}
		for _, sub := range c.Commands() {
			setURL(sub)
		}
	}
	setURL(root)
	err = root.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

// Every millwright-bench line the README and docs/ show names a bench
// that exists and flags it has.
func TestDocsNameRealBenchesAndFlags(t *testing.T) { // not parallel: the global rootCmd
	seen := clitest.CheckDocs(t, rootCmd, filepath.Join("..", ".."))
	t.Logf("%d command lines checked", seen)
	require.Greater(t, seen, 15, "the docs' millwright-bench lines were found")
}

// Every bench has a short description, usage text for every flag and a
// --help that runs.
func TestHelpOfEveryBench(t *testing.T) { // not parallel: the global rootCmd
	names := []string{}
	for _, c := range rootCmd.Commands() {
		if c.Name() == "help" || c.Name() == "completion" {
			continue // cobra's own
		}
		names = append(names, c.Name())
		require.NotEmpty(t, strings.TrimSpace(c.Short), c.Name())
		check := func(f *pflag.Flag) {
			require.NotEmpty(t, strings.TrimSpace(f.Usage), "%s --%s", c.Name(), f.Name)
		}
		c.LocalFlags().VisitAll(check)
		c.InheritedFlags().VisitAll(check)
		out, _, err := runCLI(t, rootCmd, nil, "", c.Name(), "--help")
		require.NoError(t, err, c.Name())
		require.Contains(t, out, "Usage:", c.Name())
	}
	require.Subset(t, names, []string{"consume", "debezium", "idempotency", "outbox", "relay-memory", "saga", "transport"})
}
