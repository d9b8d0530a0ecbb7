// Package clitest checks a command tree against the command lines the
// README and docs/*.md show, for the operator command and the benchmark
// command alike.
package clitest

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// CheckDocs reads README.md and docs/*.md under repo (the module's root)
// and, for every line in their code spans and blocks that runs the
// command root names (`name ...` or `go run ./cmd/name ...`), reports an
// error on t unless the words name a command of root and every --flag is
// one that command has. It returns how many lines it checked.
func CheckDocs(t *testing.T, root *cobra.Command, repo string) int {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(repo, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, filepath.Join(repo, "README.md"))
	name := regexp.QuoteMeta(root.Name())
	span := regexp.MustCompile("(?s)```[a-z]*\n(.*?)```|`([^`\n]+)`")
	line := regexp.MustCompile(`(?:^|\s|\()(?:go run \./cmd/)?` + name + ` ([^\n#|)]*)`)
	word := regexp.MustCompile(`^[a-z][a-z-]*$`)
	seen := 0
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
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
				where := f + ": " + root.Name() + " " + l[1]
				cmd := FindCommand(root, path)
				if cmd == nil {
					t.Errorf("%s: no command %q", where, strings.Join(path, " "))
					continue
				}
				seen++
				for _, w := range fields {
					if !strings.HasPrefix(w, "--") {
						continue
					}
					flag, _, _ := strings.Cut(strings.TrimPrefix(w, "--"), "=")
					flag = strings.TrimRight(flag, ".,;:")
					if flag == "help" {
						continue // cobra adds it to every command as it runs
					}
					if cmd.Flags().Lookup(flag) == nil && cmd.InheritedFlags().Lookup(flag) == nil {
						t.Errorf("%s: %s has no flag --%s", where, cmd.CommandPath(), flag)
					}
				}
			}
		}
	}
	return seen
}

// FindCommand follows path from root as far as it names subcommands; the
// words after are arguments. nil when the first word is no command.
func FindCommand(root *cobra.Command, path []string) *cobra.Command {
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
