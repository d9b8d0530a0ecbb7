package outbox_test

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// deps lists the packages pkg links (go list -deps).
func deps(t *testing.T, pkg string) []string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	out, err := exec.Command(goTool, "list", "-deps", pkg).CombinedOutput()
	require.NoError(t, err, "%s", out)
	return strings.Fields(string(out))
}

// A service that only writes events links package outbox, and with it
// neither the relay nor CDC capture: no outbox/relay, no outbox/capture,
// none of the long-running machinery only they use (internal/runner's
// lifecycle, internal/schemacheck's start-up check).
func TestWriteSideLinksNoRelay(t *testing.T) {
	t.Parallel()
	const mod = "github.com/millwright/millwright/"
	writer := deps(t, mod+"outbox")
	require.Contains(t, writer, mod+"outbox", "go list -deps lists the package itself")
	relayOnly := []string{mod + "outbox/relay", mod + "outbox/capture", mod + "internal/runner", mod + "internal/schemacheck"}
	for _, p := range relayOnly {
		require.False(t, slices.Contains(writer, p), "package outbox links %s", p)
	}
	// The relay does link them: the list above is what a writer is spared.
	relay := deps(t, mod+"outbox/relay")
	for _, p := range []string{mod + "outbox/relay", mod + "internal/runner", mod + "internal/schemacheck"} {
		require.Contains(t, relay, p)
	}
	require.Contains(t, deps(t, mod+"outbox/capture"), mod+"internal/runner")
}
