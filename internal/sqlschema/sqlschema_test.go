package sqlschema

import (
	"strings"
	"testing"
)

func TestInsertSelect(t *testing.T) {
	got := InsertSelect(`"public"."watermill_t"`, `SELECT 'u' AS uuid, ''::bytea AS payload, '{}'::json AS metadata, 1 AS position`)
	for _, want := range []string{`INSERT INTO "public"."watermill_t" (uuid, payload, metadata, transaction_id)`, `ORDER BY q.position`, `pg_current_xact_id()`} {
		if !strings.Contains(got, want) {
			t.Errorf("InsertSelect = %q, want it to contain %q", got, want)
		}
	}
}
