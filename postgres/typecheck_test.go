package postgres_test

import (
	"encoding/json"
	"go/ast"
	"go/importer"
	"go/parser"
	"go/token"
	"go/types"
	"io"
	"os"
	"os/exec"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// publicPackages are the packages a service imports.
var publicPackages = []string{
	"github.com/millwright/millwright",
	"github.com/millwright/millwright/audit",
	"github.com/millwright/millwright/failure",
	"github.com/millwright/millwright/outbox/capture",
	"github.com/millwright/millwright/outbox/relay",
	"github.com/millwright/millwright/retention",
	"github.com/millwright/millwright/cloudevent",
	"github.com/millwright/millwright/console",
	"github.com/millwright/millwright/dlq",
	"github.com/millwright/millwright/health",
	"github.com/millwright/millwright/idempotency",
	"github.com/millwright/millwright/migrate",
	"github.com/millwright/millwright/outbox",
	"github.com/millwright/millwright/outbox/capture",
	"github.com/millwright/millwright/outbox/outboxtest",
	"github.com/millwright/millwright/outbox/relay",
	"github.com/millwright/millwright/park",
	"github.com/millwright/millwright/postgres",
	"github.com/millwright/millwright/retention",
	"github.com/millwright/millwright/retry",
	"github.com/millwright/millwright/saga",
	"github.com/millwright/millwright/saga/sagatest",
}

// exportImporter type-checks against the compiler's export data of pkgs and
// their dependencies, as `go build` sees them.
func exportImporter(t *testing.T, fset *token.FileSet, pkgs ...string) types.Importer {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-export", "-deps", "-json=ImportPath,Export"}, pkgs...)...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	require.NoError(t, err, "go list -export")
	exports := map[string]string{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p struct{ ImportPath, Export string }
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else {
			require.NoError(t, err)
		}
		exports[p.ImportPath] = p.Export
	}
	return importer.ForCompiler(fset, "gc", func(path string) (io.ReadCloser, error) {
		f, ok := exports[path]
		if !ok || f == "" {
			return nil, os.ErrNotExist
		}
		return os.Open(f)
	})
}

func typeCheck(t *testing.T, imp types.Importer, fset *token.FileSet, src string) error {
	t.Helper()
	f, err := parser.ParseFile(fset, "service.go", src, 0)
	require.NoError(t, err)
	_, err = (&types.Config{Importer: imp}).Check("service", fset, []*ast.File{f}, nil)
	return err
}

// TestAPoolWhereATransactionIsRequiredDoesNotCompile type-checks a
// service's code with go/types: the writes that must share the business
// transaction take a postgres.Tx, and a pool (raw or wrapped) is refused
// by the compiler; the same code with the transaction compiles.
func TestAPoolWhereATransactionIsRequiredDoesNotCompile(t *testing.T) {
	if testing.Short() {
		t.Skip("builds export data")
	}
	t.Parallel()
	fset := token.NewFileSet()
	imp := exportImporter(t, fset, "github.com/millwright/millwright/outbox", "github.com/millwright/millwright/saga", "github.com/millwright/millwright/dlq")
	program := func(body string) string {
		return `package service

import (
	"context"
	"database/sql"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

var (
	_ = dlq.ResolveTx
	_ = saga.ResolveTx
	_ *pgxpool.Pool
)

func write(ctx context.Context, db *sql.DB, pool *pgxpool.Pool, tx *sql.Tx) error {
	ev := outbox.Event{Topic: "orders"}
	_, _, _, _ = db, pool, tx, ev
	` + body + `
}
`
	}
	for _, c := range []struct{ body, want string }{
		{`return outbox.Add(ctx, db, ev)`, `cannot use db (variable of type *sql.DB) as postgres.Tx value in argument to outbox.Add`},
		{`return outbox.Add(ctx, pool, ev)`, `cannot use pool (variable of type *pgxpool.Pool) as postgres.Tx value in argument to outbox.Add`},
		{`return outbox.Add(ctx, postgres.SQL(db), ev)`, `cannot use postgres.SQL(db) (value of struct type postgres.DB) as postgres.Tx value in argument to outbox.Add`},
		{`p, err := outbox.NewTxPublisher(postgres.From(pool), outbox.PublisherConfig{}); _ = p; return err`, `as postgres.Tx value in argument to outbox.NewTxPublisher`},
		{`_, err := dlq.ResolveTx(ctx, postgres.SQL(db), 1, dlq.Resolution{}); return err`, `as postgres.Tx value in argument to dlq.ResolveTx`},
		{`_, err := saga.ResolveTx(ctx, postgres.Pgx(pool), "s-1", saga.ResolveRetry, "", true); return err`, `as postgres.Tx value in argument to saga.ResolveTx`},
	} {
		err := typeCheck(t, imp, fset, program(c.body))
		require.Error(t, err, c.body)
		require.Contains(t, err.Error(), c.want, c.body)
	}
	// The same calls with the transaction compile, and so does the named
	// write outside one.
	for _, body := range []string{
		`return outbox.Add(ctx, postgres.SQLTx(tx), ev)`,
		`return outbox.AddOutsideTx(ctx, postgres.SQL(db), ev)`,
		`return outbox.AddOutsideTx(ctx, postgres.From(pool), ev)`,
		`_, err := dlq.ResolveTx(ctx, postgres.SQLTx(tx), 1, dlq.Resolution{}); return err`,
	} {
		require.NoError(t, typeCheck(t, imp, fset, program(body)), body)
	}
}

// anyParams allows the exported functions whose `any` parameter is a value
// to encode or decode, never a database handle.
var anyParams = map[string]bool{
	"dlq.DecodeJSON v":        true,
	"saga.NewReply payload":   true,
	"saga.Reply.Decode v":     true,
	"saga.ReplyEvent payload": true,
	// The event a waiting step waits for: a value to encode.
	"saga.Orchestrator.Signal payload":      true,
	"saga.Orchestrator.SignalEvent payload": true,
	// The simulator's replies and events: values to encode.
	"sagatest.Simulator.Reply payload":       true,
	"sagatest.Simulator.ReplyTo payload":     true,
	"sagatest.Simulator.Signal payload":      true,
	"sagatest.Simulator.SignalEvent payload": true,
}

// TestNoPublicWriteTakesAny: no exported function or method of the
// public packages takes `any` (or interface{}) where a database handle
// could go; the few that take a value to encode or decode are listed.
func TestNoPublicWriteTakesAny(t *testing.T) {
	if testing.Short() {
		t.Skip("builds export data")
	}
	t.Parallel()
	fset := token.NewFileSet()
	imp := exportImporter(t, fset, publicPackages...)
	var found []string
	for _, path := range publicPackages {
		pkg, err := imp.Import(path)
		require.NoError(t, err, path)
		check := func(name string, sig *types.Signature) {
			for i := range sig.Params().Len() {
				p := sig.Params().At(i)
				typ := p.Type()
				if s, ok := typ.(*types.Slice); ok && sig.Variadic() && i == sig.Params().Len()-1 {
					typ = s.Elem()
				}
				if _, generic := typ.(*types.TypeParam); generic {
					continue // the saga's data type D, chosen by the service
				}
				if iface, ok := typ.Underlying().(*types.Interface); ok && iface.Empty() {
					key := pkg.Name() + "." + name + " " + p.Name()
					if !anyParams[key] {
						found = append(found, key)
					}
				}
			}
		}
		for _, n := range pkg.Scope().Names() {
			obj := pkg.Scope().Lookup(n)
			if !obj.Exported() {
				continue
			}
			if fn, ok := obj.(*types.Func); ok {
				check(n, fn.Type().(*types.Signature))
			}
			if tn, ok := obj.(*types.TypeName); ok {
				if named, ok := tn.Type().(*types.Named); ok {
					for i := range named.NumMethods() {
						m := named.Method(i)
						if m.Exported() {
							check(n+"."+m.Name(), m.Type().(*types.Signature))
						}
					}
				}
			}
		}
	}
	sort.Strings(found)
	require.Empty(t, found, "exported functions taking any: type the parameter (postgres.DB, postgres.Tx, postgres.Handle), or list it in anyParams if it is a value to encode or decode")
}
