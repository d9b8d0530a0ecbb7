package sql

import (
	"errors"
	"fmt"
	"testing"

	"github.com/lib/pq"
)

// TestLostCreateRace: the errors Postgres gives the loser of two concurrent
// CREATE TABLE IF NOT EXISTS of one table (seen in watermill's suite:
// "could not initialize schema: pq: duplicate key value violates unique
// constraint \"pg_type_typname_nsp_index\"") are taken as "the table now
// exists", wrapped as watermill-sql wraps them; other errors are not.
func TestLostCreateRace(t *testing.T) {
	t.Parallel()
	typeIndex := &pq.Error{Code: "23505", Constraint: "pg_type_typname_nsp_index",
		Message: `duplicate key value violates unique constraint "pg_type_typname_nsp_index"`}
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{typeIndex, true},
		{fmt.Errorf("could not initialize schema: %w", typeIndex), true},
		{&pq.Error{Code: "23505", Message: `duplicate key value violates unique constraint "pg_type_typname_nsp_index"`}, true},
		{&pq.Error{Code: "42P07", Message: `relation "watermill_x" already exists`}, true},
		{&pq.Error{Code: "23505", Constraint: "watermill_x_pkey", Message: "duplicate key value"}, false},
		{&pq.Error{Code: "42501", Message: "permission denied for schema public"}, false},
		{errors.New("pg_type_typname_nsp_index"), false},
		{nil, false},
	} {
		if got := lostCreateRace(tc.err); got != tc.want {
			t.Errorf("lostCreateRace(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}
