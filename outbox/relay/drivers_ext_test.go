package relay_test

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
)

// relayOn is relay.New on a pool of either driver (pgtest's
// Schema.Handle).
func relayOn(h any, pub message.Publisher, cfg relay.Config) (*relay.Relay, error) {
	switch db := h.(type) {
	case *sql.DB:
		return relay.New(postgres.From(db), pub, cfg)
	case *pgxpool.Pool:
		return relay.New(postgres.From(db), pub, cfg)
	}
	return nil, fmt.Errorf("no relay on a %T", h)
}

// inTx runs f in a transaction of h's driver, as a user's code would,
// and commits it if f returns nil.
func inTx(ctx context.Context, h any, f func(tx postgres.Tx) error) error {
	switch db := h.(type) {
	case *sql.DB:
		return postgres.SQL(db).InTx(ctx, f)
	case *pgxpool.Pool:
		return postgres.Pgx(db).InTx(ctx, f)
	}
	return fmt.Errorf("no transaction on a %T", h)
}
