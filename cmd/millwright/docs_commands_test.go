package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
)

// Every millwright command line the README and docs/ show (in code spans
// and code blocks) names commands that exist and flags those commands
// have, so that a renamed command or flag fails here, not in an
// operator's shell.
func TestDocsNameRealCommandsAndFlags(t *testing.T) { // not parallel: the global rootCmd
	files, err := filepath.Glob(filepath.Join("..", "..", "docs", "*.md"))
	require.NoError(t, err)
	files = append(files, filepath.Join("..", "..", "README.md"))
	span := regexp.MustCompile("(?s)```[a-z]*\n(.*?)```|`([^`\n]+)`")
	line := regexp.MustCompile(`(?:^|\s|\()(?:go run \./cmd/)?millwright ([^\n#|)]*)`)
	word := regexp.MustCompile(`^[a-z][a-z-]*$`)
	seen := 0
	for _, f := range files {
		raw, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range span.FindAllStringSubmatch(string(raw), -1) {
			code := m[1] + m[2]
			for _, l := range line.FindAllStringSubmatch(code, -1) {
				fields := strings.Fields(strings.NewReplacer("[", " ", "]", " ", "`", " ").Replace(l[1]))
				var path []string
				for _, w := range fields {
					if !word.MatchString(w) {
						break
					}
					path = append(path, w)
				}
				if len(path) == 0 {
					continue
				}
				where := f + ": millwright " + l[1]
				cmd := findCommand(rootCmd, path)
				if cmd == nil {
					t.Errorf("%s: no command %q", where, strings.Join(path, " "))
					continue
				}
				seen++
				for _, w := range fields {
					if !strings.HasPrefix(w, "--") {
						continue
					}
					name, _, _ := strings.Cut(strings.TrimPrefix(w, "--"), "=")
					name = strings.TrimRight(name, ".,;:")
					if name == "help" {
						continue // cobra adds it to every command as it runs
					}
					if cmd.Flags().Lookup(name) == nil && cmd.InheritedFlags().Lookup(name) == nil {
						t.Errorf("%s: %s has no flag --%s", where, cmd.CommandPath(), name)
					}
				}
			}
		}
	}
	t.Logf("%d command lines checked", seen)
	require.Greater(t, seen, 40, "the docs' command lines were found")
}

// findCommand follows path from root as far as it names subcommands; the
// words after are arguments. nil when the first word is no command.
func findCommand(root *cobra.Command, path []string) *cobra.Command {
	cmd := root
	for _, w := range path {
		var next *cobra.Command
		for _, sub := range cmd.Commands() {
			if sub.Name() == w {
				next = sub
			}
		}
		if next == nil {
			break
		}
		cmd = next
	}
	if cmd == root {
		return nil
	}
	return cmd
}
