package main

import (
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/require"
)

// Every command and subcommand of the CLI (the whole tree, walked, so a
// new command is covered without being listed) has a short description,
// a usage line for every flag, and a --help that prints neither an empty
// description nor a doubled parenthesis: `relay --help` once printed
// "MILLWRIGHT_DATABASE_URL ((required))".
func TestHelpOfEveryCommand(t *testing.T) { // not parallel: the global rootCmd
	var paths [][]string
	var walk func(c *cobra.Command, path []string)
	walk = func(c *cobra.Command, path []string) {
		paths = append(paths, path)
		for _, sub := range c.Commands() {
			if sub.Name() == "help" || sub.Name() == "completion" {
				continue // cobra's own
			}
			walk(sub, append(append([]string{}, path...), sub.Name()))
		}
	}
	walk(rootCmd, nil)
	require.Greater(t, len(paths), 25, "the walk found the tree")

	for _, path := range paths {
		name := strings.Join(append([]string{"millwright"}, path...), " ")
		c, _, err := rootCmd.Find(path)
		require.NoError(t, err, name)
		if strings.TrimSpace(c.Short) == "" {
			t.Errorf("%s has no Short description", name)
		}
		check := func(f *pflag.Flag) {
			if strings.TrimSpace(f.Usage) == "" {
				t.Errorf("%s: flag --%s has no usage text", name, f.Name)
			}
		}
		c.LocalFlags().VisitAll(check)
		c.InheritedFlags().VisitAll(check)

		out, _, err := runCLI(t, rootCmd, nil, "", append(append([]string{}, path...), "--help")...)
		require.NoError(t, err, "%s --help", name)
		if strings.Contains(out, "((") {
			t.Errorf("%s --help prints a doubled parenthesis:\n%s", name, out)
		}
		if !strings.Contains(out, "Usage:") {
			t.Errorf("%s --help prints no usage:\n%s", name, out)
		}
		if strings.TrimSpace(strings.SplitN(out, "\n", 2)[0]) == "" {
			t.Errorf("%s --help starts with an empty description:\n%s", name, out)
		}
	}
}

// The operator command carries no benchmark: `millwright --help` points
// to millwright-bench once, and there is no bench subcommand.
func TestHelpPointsToTheBenchCommand(t *testing.T) { // not parallel: the global rootCmd
	out, _, err := runCLI(t, rootCmd, nil, "", "--help")
	require.NoError(t, err)
	require.Equal(t, 1, strings.Count(out, "millwright-bench"), "millwright --help:\n%s", out)
	require.Nil(t, subcommand(rootCmd, "bench"), "millwright has a bench command")
}

// subcommand is the direct subcommand of root called name, or nil.
func subcommand(root *cobra.Command, name string) *cobra.Command {
	for _, c := range root.Commands() {
		if c.Name() == name {
			return c
		}
	}
	return nil
}
