package main

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The operator binary links no in-process development fake: kfake and
// pstest are for the benchmarks (millwright-bench) and tests, and a
// production deployment of `millwright relay` must not carry them.
func TestOperatorBinaryLinksNoFake(t *testing.T) {
	t.Parallel()
	deps := goListDeps(t, ".")
	require.Contains(t, deps, "github.com/millwright/millwright/transport/kafka", "go list -deps found the transports the CLI links")
	for _, dep := range deps {
		for _, fake := range []string{"github.com/twmb/franz-go/pkg/kfake", "cloud.google.com/go/pubsub/pstest", "github.com/millwright/millwright/transport/embedded"} {
			if dep == fake || strings.HasPrefix(dep, fake+"/") {
				t.Errorf("cmd/millwright links %s: the fakes belong to millwright-bench and tests (go list -deps ./cmd/millwright)", dep)
			}
		}
	}
}

// goListDeps is `go list -deps pkg`: every package pkg links, standard
// library included.
func goListDeps(t *testing.T, pkg string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "go", "list", "-deps", pkg).Output()
	var stderr string
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = string(ee.Stderr)
	}
	require.NoError(t, err, "go list -deps %s: %s", pkg, stderr)
	return strings.Fields(string(out))
}
