package outbox_test

import (
	"go/ast"
	"go/parser"
	"go/token"
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

// Package outbox exports no process state: no package-level variable but
// its sentinel errors, and no setter. What Add checks against belongs to
// a Writer.
func TestOutboxExportsNoProcessState(t *testing.T) {
	t.Parallel()
	fset := token.NewFileSet()
	names, err := filepath.Glob("*.go")
	require.NoError(t, err)
	var files []*ast.File
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		require.NoError(t, err)
		files = append(files, f)
	}
	require.NotEmpty(t, files)
	var vars, setters []string
	for _, f := range files {
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.GenDecl:
				if d.Tok != token.VAR {
					continue
				}
				for _, s := range d.Specs {
					for _, n := range s.(*ast.ValueSpec).Names {
						if n.IsExported() && !strings.HasPrefix(n.Name, "Err") {
							vars = append(vars, n.Name)
						}
					}
				}
			case *ast.FuncDecl:
				if d.Recv == nil && d.Name.IsExported() && strings.HasPrefix(d.Name.Name, "Set") {
					setters = append(setters, d.Name.Name)
				}
			}
		}
	}
	require.Empty(t, vars, "exported package-level variables")
	require.Empty(t, setters, "exported setters")
}
