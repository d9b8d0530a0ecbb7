// Package metricscheck finds the Prometheus metric names millwright's code
// exports and the names that PromQL expressions use, so a test can prove
// that the shipped alert rules (deploy/prometheus/alerts.yml), the Grafana
// dashboard (deploy/grafana/millwright.json) and the metrics page
// (docs/metrics.md) name only metrics that exist, and show all of them.
//
// Exported names are read from the source: every string constant whose name
// starts with "Metric" in the component packages (Packages). Reading the
// source rather than a hand-kept list means a metric added to a component
// is seen at once, and the test asks for it to be documented and charted.
//
// Lint checks the names themselves (Prefix, promlint); the package's test
// builds every component's registry and lints what it gathers.
package metricscheck

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
)

// Packages are the directories (relative to the module root) whose
// Metric* constants name exported metrics.
var Packages = []string{"outbox", "outbox/relay", "outbox/capture", "idempotency", "retry", "dlq", "park", "saga",
	"transport/sql", "transport/amqp", "transport/googlecloud", "transport/kafka",
	"transport/lag", "transport/nats"}

// Source says where a metric name is defined.
type Source struct {
	Package, Const string
}

// Exported parses the non-test Go files of Packages under root and returns
// every metric name with where it is defined.
func Exported(root string) (map[string]Source, error) {
	out := map[string]Source{}
	for _, pkg := range Packages {
		dir := filepath.Join(root, pkg)
		entries, err := os.ReadDir(dir)
		if err != nil {
			return nil, fmt.Errorf("metricscheck: reading package %s: %w", pkg, err)
		}
		fset := token.NewFileSet()
		for _, e := range entries {
			if e.IsDir() || !strings.HasSuffix(e.Name(), ".go") || strings.HasSuffix(e.Name(), "_test.go") {
				continue
			}
			f, err := parser.ParseFile(fset, filepath.Join(dir, e.Name()), nil, 0)
			if err != nil {
				return nil, fmt.Errorf("metricscheck: parsing %s/%s: %w", pkg, e.Name(), err)
			}
			for _, d := range f.Decls {
				gd, ok := d.(*ast.GenDecl)
				if !ok || gd.Tok != token.CONST {
					continue
				}
				for _, s := range gd.Specs {
					vs := s.(*ast.ValueSpec)
					for i, n := range vs.Names {
						if !strings.HasPrefix(n.Name, "Metric") || !n.IsExported() || i >= len(vs.Values) {
							continue
						}
						lit, ok := vs.Values[i].(*ast.BasicLit)
						if !ok || lit.Kind != token.STRING {
							continue
						}
						v, err := strconv.Unquote(lit.Value)
						if err != nil {
							return nil, fmt.Errorf("metricscheck: %s.%s: %w", pkg, n.Name, err)
						}
						out[v] = Source{Package: pkg, Const: n.Name}
					}
				}
			}
		}
	}
	return out, nil
}

var (
	stringLit  = regexp.MustCompile("\"(?:[^\"\\\\]|\\\\.)*\"|'(?:[^'\\\\]|\\\\.)*'|`[^`]*`")
	braces     = regexp.MustCompile(`\{[^{}]*\}`)
	brackets   = regexp.MustCompile(`\[[^\[\]]*\]`)
	grouping   = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)`)
	identifier = regexp.MustCompile(`[A-Za-z_:][A-Za-z0-9_:]*`)
	labelVals  = regexp.MustCompile(`label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,[^()]*\)`)
	keywords   = map[string]bool{
		"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
		"bool": true, "and": true, "or": true, "unless": true, "offset": true, "inf": true, "nan": true,
		"Inf": true, "NaN": true, "atan2": true,
	}
)

// Names returns the metric names a PromQL expression selects (without
// their label matchers), sorted and deduplicated. It also understands
// Grafana's label_values(metric, label) template queries. It is a lexical
// scan, not a parser: it drops strings, label matchers, ranges and grouping
// label lists, then keeps identifiers that are not functions or keywords.
func Names(expr string) []string {
	seen := map[string]bool{}
	expr = labelVals.ReplaceAllString(expr, "$1")
	expr = stringLit.ReplaceAllString(expr, `""`)
	for _, re := range []*regexp.Regexp{braces, brackets, grouping} {
		for {
			next := re.ReplaceAllString(expr, " ")
			if next == expr {
				break
			}
			expr = next
		}
	}
	for _, loc := range identifier.FindAllStringIndex(expr, -1) {
		name := expr[loc[0]:loc[1]]
		if keywords[name] {
			continue
		}
		if loc[0] > 0 { // part of a number (1e3) or duration (5m)
			if c := expr[loc[0]-1]; c >= '0' && c <= '9' || c == '.' {
				continue
			}
		}
		rest := strings.TrimLeft(expr[loc[1]:], " \t\n")
		if strings.HasPrefix(rest, "(") { // function or aggregation
			continue
		}
		seen[name] = true
	}
	names := make([]string, 0, len(seen))
	for n := range seen {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Resolve returns the exported metric a name selects: the name itself, or
// for a histogram series its base name without _bucket, _sum or _count.
func Resolve(name string, exported map[string]Source) (string, bool) {
	if _, ok := exported[name]; ok {
		return name, true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suf); ok {
			if _, ok := exported[base]; ok {
				return base, true
			}
		}
	}
	return "", false
}

// Prefix starts the name of every metric millwright exports: one
// application namespace, as Prometheus's naming guide asks. A name reads
// millwright_<component>_<what>_<unit>, where component is the package or
// transport kind (outbox, dlq, saga, sql, googlecloud, ...), unit is a base
// unit in plural (seconds, bytes) or the thing counted (events, messages),
// and a counter ends in _total.
const Prefix = "millwright_"

// Lint checks gathered metric families with client_golang's promlint (the
// linter `promtool check metrics` runs) plus millwright's own rules: every
// name starts with Prefix, and no gauge or histogram is named like another
// family's counter without _total (OpenMetrics names a counter's family
// without the suffix, so millwright_x and millwright_x_total would clash).
func Lint(mfs []*dto.MetricFamily) ([]promlint.Problem, error) {
	l := promlint.NewWithMetricFamilies(mfs)
	l.AddCustomValidations(func(mf *dto.MetricFamily) []error {
		if !strings.HasPrefix(mf.GetName(), Prefix) {
			return []error{fmt.Errorf("name does not start with %q (one application namespace): rename it %s<component>_...", Prefix, Prefix)}
		}
		return nil
	})
	problems, err := l.Lint()
	counters := map[string]bool{}
	for _, mf := range mfs {
		if mf.GetType() == dto.MetricType_COUNTER {
			counters[strings.TrimSuffix(mf.GetName(), "_total")] = true
		}
	}
	for _, mf := range mfs {
		if mf.GetType() != dto.MetricType_COUNTER && counters[mf.GetName()] {
			problems = append(problems, promlint.Problem{Metric: mf.GetName(),
				Text: "has the OpenMetrics family name of counter " + mf.GetName() + "_total: give one of them another name"})
		}
	}
	sort.Slice(problems, func(i, j int) bool { return problems[i].Metric < problems[j].Metric })
	return problems, err
}
