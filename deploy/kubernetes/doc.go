// Package kubernetes holds an example Kubernetes manifest for `millwright
// relay` (relay.yaml: a Deployment with probes, resources and the
// environment, and a Service for /metrics). It has no Go code; its test,
// cmd/millwright/deploy_kubernetes_test.go,
// checks the manifest's variable names, ports and paths against the code
// (the relay command's variables, package health), so the example cannot drift.
package kubernetes
