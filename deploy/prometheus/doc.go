// Package prometheus holds millwright's Prometheus alerting rules
// (alerts.yml). It has no Go code; its test checks that every rule has a
// runbook_url whose section exists in docs/runbooks.md. The metric names
// the rules use are checked by internal/testing/metricscheck.
package prometheus
