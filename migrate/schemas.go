package migrate

import (
	"context"
	"fmt"
	"time"

	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/postgres"
)

// Schemas returns the schemas of db holding at least one of the tables
// the operator console reads (dead letters, outbox, saga instances,
// audit), by name: the schemas a multi-tenant console offers.
func Schemas(ctx context.Context, db postgres.DB) ([]string, error) {
	pool, err := storage.FromDB(db)
	if err != nil {
		return nil, fmt.Errorf("migrate: Schemas: %w", err)
	}
	out, err := storage.ListConsoleSchemas(ctx, pool)
	if err != nil {
		return nil, fmt.Errorf("migrate: listing the schemas with millwright tables: %w", err)
	}
	return out, nil
}

// CurrentSchema returns the schema db's connections write to (the first
// existing schema of their search_path), "" when none exists.
func CurrentSchema(ctx context.Context, db postgres.DB) (string, error) {
	pool, err := storage.FromDB(db)
	if err != nil {
		return "", fmt.Errorf("migrate: CurrentSchema: %w", err)
	}
	var s string
	if err := pool.QueryRow(ctx, storage.S(`SELECT COALESCE(current_schema()::text, '')`), &s); err != nil {
		return "", fmt.Errorf("migrate: reading the current schema: %w", err)
	}
	return s, nil
}

// InSchema runs fn in a transaction of db whose search_path is schema
// alone (SET LOCAL: the pool's connections are untouched), read-only when
// readOnly: the operator console serves every schema of one database this
// way, calling the packages' ...Tx reads and actions inside. The
// transaction commits when fn returns nil and rolls back otherwise.
func InSchema(ctx context.Context, db postgres.DB, schema string, readOnly bool, fn func(postgres.Tx) error) error {
	pool, err := storage.FromDB(db)
	if err != nil {
		return fmt.Errorf("migrate: InSchema: %w", err)
	}
	if schema == "" {
		return fmt.Errorf("migrate: InSchema: the schema is empty: name one (see Schemas)")
	}
	tx, err := pool.Begin(ctx, storage.TxOptions{ReadOnly: readOnly, First: []storage.Statement{storage.SetLocalSearchPath(schema)}})
	if err != nil {
		return fmt.Errorf("opening a transaction in schema %s: %w", schema, err)
	}
	defer func() {
		// Bounded, and run even when ctx has ended (no-op after Commit).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	if err := fn(storage.TxOf(tx)); err != nil {
		return err
	}
	return tx.Commit(ctx)
}
