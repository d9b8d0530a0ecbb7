package failure_test

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// goList runs `go list args...` in the module's root and returns its
// output's fields.
func goList(t *testing.T, args ...string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", append([]string{"list"}, args...)...)
	cmd.Dir = ".."
	out, err := cmd.Output()
	var stderr string
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = string(ee.Stderr)
	}
	require.NoError(t, err, "go list %s: %s", strings.Join(args, " "), stderr)
	return strings.Fields(string(out))
}

// failure is a leaf: it links the standard library only, so anything may
// import it.
func TestFailureImportsOnlyTheStandardLibrary(t *testing.T) {
	t.Parallel()
	deps := goList(t, "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", "./failure")
	require.Equal(t, []string{"github.com/millwright/millwright/failure"}, deps)
}

// The transports and cloudevent mark permanent errors through failure and
// link no part of the retry middleware.
func TestTransportAndCloudeventLinkNoRetry(t *testing.T) {
	t.Parallel()
	deps := goList(t, "-deps", "./transport/...", "./cloudevent")
	require.Contains(t, deps, "github.com/millwright/millwright/failure", "go list -deps found the transports")
	require.NotContains(t, deps, "github.com/millwright/millwright/retry", "a package of ./transport/... or ./cloudevent links retry (go list -deps ./transport/... ./cloudevent): import failure for Permanent/IsPermanent")
}
