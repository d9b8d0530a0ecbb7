// Package storagetest is the storage layer's driver suite, as river's
// riverdrivertest.Exercise: every operation's contract, run against each
// driver (database/sql on lib/pq, and pgx v5) on a fresh schema with all
// of millwright's migrations applied.
//
// Each domain's contracts live in a file of their own and register with
// Register, so that Exercise runs them all.
package storagetest

import (
	"sort"
	"sync"
	"testing"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrations"
)

// Setup gives a contract a fresh schema with every migration applied, and
// its pool on the driver under test.
type Setup struct {
	Schema *pgtest.Schema
	Pool   storage.Pool
	Driver string
}

// Contract checks one operation (or a group) on one driver.
type Contract func(t *testing.T, setup func(t *testing.T) Setup)

var (
	mu        sync.Mutex
	contracts = map[string]Contract{}
)

// Register adds a group of contracts under name (a domain: "outbox",
// "saga", ...). It is called from init functions.
func Register(name string, c Contract) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := contracts[name]; dup {
		panic("storagetest: contract " + name + " registered twice")
	}
	contracts[name] = c
}

// Exercise runs every registered contract on each driver of the matrix
// (pgtest.Drivers).
func Exercise(t *testing.T) {
	mu.Lock()
	names := make([]string, 0, len(contracts))
	for n := range contracts {
		names = append(names, n)
	}
	mu.Unlock()
	sort.Strings(names)
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		for _, n := range names {
			t.Run(n, func(t *testing.T) {
				contracts[n](t, func(t *testing.T) Setup {
					s := pgtest.New(t, migrations.All()...)
					return Setup{Schema: s, Pool: s.Pool(t, driver), Driver: driver}
				})
			})
		}
	})
}
