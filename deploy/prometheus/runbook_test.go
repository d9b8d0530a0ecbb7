package prometheus_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
)

const root = "../.."

type rules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// anchors returns the link targets of a Markdown file as GitHub renders
// them: each heading's slug, and every explicit <a id="...">.
func anchors(t *testing.T, md string) map[string]bool {
	t.Helper()
	out := map[string]bool{}
	inFence := false
	nonSlug := regexp.MustCompile(`[^\p{L}\p{N} _-]`)
	for _, line := range strings.Split(md, "\n") {
		if strings.HasPrefix(line, "```") {
			inFence = !inFence
			continue
		}
		if inFence {
			continue
		}
		if m := regexp.MustCompile(`^#{1,6} (.+)$`).FindStringSubmatch(line); m != nil {
			slug := strings.ToLower(strings.TrimSpace(m[1]))
			slug = nonSlug.ReplaceAllString(slug, "")
			slug = strings.ReplaceAll(slug, " ", "-")
			require.False(t, out[slug], "two headings with anchor #%s", slug)
			out[slug] = true
		}
		for _, m := range regexp.MustCompile(`<a id="([^"]+)"></a>`).FindAllStringSubmatch(line, -1) {
			out[m[1]] = true
		}
	}
	return out
}

// Every alert rule links to its own section of docs/runbooks.md.
func TestEveryRuleHasARunbook(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("alerts.yml")
	require.NoError(t, err)
	var f rules
	require.NoError(t, yaml.Unmarshal(raw, &f))
	seen := map[string]string{}
	n := 0
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			n++
			u := r.Annotations["runbook_url"]
			require.NotEmpty(t, u, "rule %s (group %s) has no runbook_url annotation", r.Alert, g.Name)
			file, anchor, ok := strings.Cut(u, "#")
			require.True(t, ok, "rule %s: runbook_url %q has no #section", r.Alert, u)
			require.Equal(t, "docs/runbooks.md", file, "rule %s: runbooks live in docs/runbooks.md", r.Alert)
			md, err := os.ReadFile(filepath.Join(root, file))
			require.NoError(t, err)
			require.True(t, anchors(t, string(md))[anchor], "rule %s: %s has no section #%s", r.Alert, file, anchor)
			require.Equal(t, strings.ToLower(r.Alert), anchor, "rule %s: its section is named after it", r.Alert)
			require.NotContains(t, seen, anchor, "rules %s and %s share a runbook section", seen[anchor], r.Alert)
			seen[anchor] = r.Alert
		}
	}
	require.Greater(t, n, 5, "the rules file was read")
}

// The anchor rules follow GitHub's.
func TestAnchors(t *testing.T) {
	t.Parallel()
	got := anchors(t, "# Runbooks\n## MillwrightSQLHorizonHeld\n```\n## not a heading\n```\n## Relay not ready\n<a id=\"old-name\"></a>\n")
	require.Equal(t, map[string]bool{"runbooks": true, "millwrightsqlhorizonheld": true, "relay-not-ready": true, "old-name": true}, got)
}
