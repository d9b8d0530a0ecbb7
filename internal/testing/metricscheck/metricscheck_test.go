package metricscheck_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/millwright/millwright/internal/testing/metricscheck"
)

const root = "../../.."

func exported(t *testing.T) map[string]metricscheck.Source {
	t.Helper()
	m, err := metricscheck.Exported(root)
	require.NoError(t, err)
	// Sanity: the scan must see the components' metrics at all.
	for _, want := range []string{"millwright_outbox_pending_events", "millwright_dlq_depth_messages", "millwright_saga_stuck_total", "millwright_retry_retries_total"} {
		require.Contains(t, m, want)
	}
	return m
}

// requireKnown fails for every name in exprs that no component exports,
// and returns the exported metrics the expressions use.
func requireKnown(t *testing.T, file string, exprs []string, known map[string]metricscheck.Source) map[string]bool {
	t.Helper()
	used := map[string]bool{}
	for _, e := range exprs {
		names := metricscheck.Names(e)
		require.NotEmpty(t, names, "%s: expression selects no metric: %s", file, e)
		for _, n := range names {
			base, ok := metricscheck.Resolve(n, known)
			require.True(t, ok, "%s names metric %q, which no component exports (expression %s); exported: %v", file, n, e, keys(known))
			used[base] = true
		}
	}
	return used
}

func keys(m map[string]metricscheck.Source) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}

type rulesFile struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

func TestAlertRules(t *testing.T) {
	t.Parallel()
	known := exported(t)
	raw, err := os.ReadFile(filepath.Join(root, "deploy/prometheus/alerts.yml"))
	require.NoError(t, err)
	var rf rulesFile
	dec := yaml.NewDecoder(strings.NewReader(string(raw)))
	dec.KnownFields(true)
	require.NoError(t, dec.Decode(&rf))

	byAlert := map[string]string{}
	forOf := map[string]string{}
	var exprs []string
	for _, g := range rf.Groups {
		for _, r := range g.Rules {
			require.NotEmpty(t, r.Alert, "group %s has a rule without a name", g.Name)
			require.NotEmpty(t, r.Expr, "alert %s has no expr", r.Alert)
			require.Contains(t, []string{"warning", "critical"}, r.Labels["severity"], "alert %s severity", r.Alert)
			require.NotEmpty(t, r.Annotations["summary"], "alert %s summary", r.Alert)
			byAlert[r.Alert] = r.Expr
			forOf[r.Alert] = r.For
			exprs = append(exprs, r.Expr)
		}
	}
	requireKnown(t, "alerts.yml", exprs, known)

	// The design's thresholds.
	design := []struct{ alert, exprRe, forDur string }{
		{"MillwrightOutboxBacklog", `millwright_outbox_pending_events\)?\s*>\s*1000$`, "5m"},
		{"MillwrightOutboxOldestPendingAge", `millwright_outbox_oldest_pending_age_seconds\)?\s*>\s*60$`, "1m"},
		{"MillwrightOutboxFailed", `millwright_outbox_failed_events\)?\s*>\s*0$`, ""},
		{"MillwrightRelayPublishSlow", `histogram_quantile\(0\.99,.*millwright_outbox_publish_latency_seconds_bucket.*>\s*5$`, "5m"},
		{"MillwrightDeadLettersArriving", `millwright_dlq_dead_letters_total`, ""},
		{"MillwrightSagaStuck", `millwright_saga_stuck_instances\)?\s*>\s*0$`, ""}, // the gauge of sagas stuck now, not the counter
	}
	for _, d := range design {
		require.Contains(t, byAlert, d.alert)
		require.Regexp(t, regexp.MustCompile(d.exprRe), byAlert[d.alert], d.alert)
		require.Equal(t, d.forDur, forOf[d.alert], "%s for:", d.alert)
	}
}

// collectExprs walks a Grafana dashboard for query expressions.
func collectExprs(v any, out *[]string) {
	switch x := v.(type) {
	case map[string]any:
		for k, val := range x {
			if s, ok := val.(string); ok && (k == "expr" || (k == "query" && strings.Contains(s, "("))) {
				*out = append(*out, s)
				continue
			}
			collectExprs(val, out)
		}
	case []any:
		for _, e := range x {
			collectExprs(e, out)
		}
	}
}

func TestDashboard(t *testing.T) {
	t.Parallel()
	known := exported(t)
	raw, err := os.ReadFile(filepath.Join(root, "deploy/grafana/millwright.json"))
	require.NoError(t, err)
	var dash map[string]any
	require.NoError(t, json.Unmarshal(raw, &dash))
	var exprs []string
	collectExprs(dash, &exprs)
	require.Greater(t, len(exprs), 10)
	used := requireKnown(t, "millwright.json", exprs, known)
	for name, src := range known {
		require.True(t, used[name], "the dashboard does not chart %s (%s.%s): add a panel", name, src.Package, src.Const)
	}
}

func TestDocsListEveryMetric(t *testing.T) {
	t.Parallel()
	known := exported(t)
	raw, err := os.ReadFile(filepath.Join(root, "docs/metrics.md"))
	require.NoError(t, err)
	doc := string(raw)
	documented := map[string]bool{}
	for _, m := range regexp.MustCompile("(?m)^\\| `([a-z_:]+)` \\| (?:gauge|counter|histogram|summary) \\|").FindAllStringSubmatch(doc, -1) {
		_, ok := known[m[1]]
		require.True(t, ok, "docs/metrics.md lists %q, which no component exports", m[1])
		documented[m[1]] = true
	}
	for name, src := range known {
		require.True(t, documented[name], "docs/metrics.md has no row for %s (%s.%s)", name, src.Package, src.Const)
		require.Contains(t, doc, "`"+src.Const+"`", "docs/metrics.md should name the constant of %s", name)
	}
}

func TestNames(t *testing.T) {
	t.Parallel()
	cases := map[string][]string{
		`max by (job) (outbox_pending_count) > 1000`: {"outbox_pending_count"},
		`histogram_quantile(0.99, sum by (job, le) (rate(relay_publish_latency_seconds_bucket{job=~"$job", x="a{b}"}[5m]))) > 5`: {"relay_publish_latency_seconds_bucket"},
		`sum without (instance) (rate(a_total[1m] offset 5m)) / on(topic) group_left(reason) b_total > 1e3`:                      {"a_total", "b_total"},
		`label_values(outbox_pending_count, job)`:                                      {"outbox_pending_count"},
		`bogus_metric{topic='x'} unless bool other:recorded`:                           {"bogus_metric", "other:recorded"},
		`increase(millwright_dlq_dead_letters_total[10m:1m]) and millwright_dlq_depth`: {"millwright_dlq_dead_letters_total", "millwright_dlq_depth"},
	}
	for expr, want := range cases {
		require.Equal(t, want, metricscheck.Names(expr), expr)
	}
	known := map[string]metricscheck.Source{"h_seconds": {}, "outbox_failed_count": {}}
	for name, want := range map[string]string{"h_seconds_bucket": "h_seconds", "h_seconds_count": "h_seconds", "outbox_failed_count": "outbox_failed_count", "h_total": ""} {
		got, _ := metricscheck.Resolve(name, known)
		require.Equal(t, want, got, name)
	}
}
