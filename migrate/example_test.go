package migrate_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"testing/fstest"
	"time"

	_ "github.com/lib/pq" // the "postgres" driver

	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/postgres"
)

// An application applies millwright's migrations and its own with one
// call, at start-up or from its deploy job; a second call applies nothing.
// Tables land in the first schema of the connection's search_path.
func ExampleUp() {
	ctx := context.Background()
	admin, err := sql.Open("postgres", exampleURL(""))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer admin.Close()
	schema := fmt.Sprintf("example_%d", time.Now().UnixNano())
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		fmt.Println("needs Postgres:", err)
		return
	}
	defer admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`)
	db, err := sql.Open("postgres", exampleURL(schema))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()

	// The application's own migrations: files NNN_name.sql, normally
	// embedded with //go:embed.
	mine := migrate.Source{Component: "shop", FS: fstest.MapFS{
		"001_orders.sql": {Data: []byte(`CREATE TABLE shop_orders (id TEXT PRIMARY KEY);`)},
	}}
	sources := append(migrations.All(), mine)
	applied, err := migrate.Up(ctx, postgres.From(db), sources...)
	if err != nil {
		fmt.Println(err)
		return
	}
	components := map[string]bool{}
	for _, a := range applied {
		components[a.Component] = true
	}
	fmt.Println("outbox:", components["outbox"], "audit:", components["audit"], "shop:", components["shop"])
	again, _ := migrate.Up(ctx, postgres.From(db), sources...)
	fmt.Println("applied again:", len(again))
	// Output:
	// outbox: true audit: true shop: true
	// applied again: 0
}

// exampleURL is the database the example uses, with search_path set to
// schema when one is given: $MILLWRIGHT_TEST_DATABASE_URL, else the local
// development server. Use your own.
func exampleURL(schema string) string {
	u := os.Getenv("MILLWRIGHT_TEST_DATABASE_URL")
	if u == "" {
		u = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
	}
	if schema == "" {
		return u
	}
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return u + sep + "search_path=" + schema
}
