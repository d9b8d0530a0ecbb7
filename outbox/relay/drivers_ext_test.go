package relay_test

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/outbox/relay"
)

// relayOn is relay.New on a pool of either driver (pgtest's
// Schema.Handle).
func relayOn(h any, pub message.Publisher, cfg relay.Config) (*relay.Relay, error) {
	switch db := h.(type) {
	case *sql.DB:
		return relay.New(db, pub, cfg)
	case *pgxpool.Pool:
		return relay.New(db, pub, cfg)
	}
	return nil, fmt.Errorf("no relay on a %T", h)
}

// inTx runs f in a transaction of h's driver, as a user's code would (f
// gets a *sql.Tx or a pgx.Tx), and commits it if f returns nil.
func inTx(ctx context.Context, h any, f func(tx any) error) error {
	switch db := h.(type) {
	case *sql.DB:
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback() //nolint:errcheck // no-op after Commit
		if err := f(tx); err != nil {
			return err
		}
		return tx.Commit()
	case *pgxpool.Pool:
		tx, err := db.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx) //nolint:errcheck // no-op after Commit
		if err := f(tx); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	return fmt.Errorf("no transaction on a %T", h)
}
