package console_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The console is built on the public API only: everything it reads or
// changes goes through the packages a service uses (dlq, outbox, saga,
// audit, migrate), so it has no path of its own to the tables. A
// package under internal/ among its imports fails this test.
func TestConsoleImportsNoInternalPackage(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-f", `{{join .Imports "\n"}}`, "github.com/millwright/millwright/console").CombinedOutput()
	require.NoError(t, err, "%s", out)
	imports := strings.Fields(string(out))
	require.Contains(t, imports, "github.com/millwright/millwright/dlq", "go list listed the console's imports")
	for _, imp := range imports {
		require.NotContains(t, imp, "/internal/", "console imports %s: use a public function of its domain package", imp)
	}
}
