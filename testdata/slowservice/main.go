// Command slowservice is a service on the client whose handlers take
// $SLOW_HOLD each, for TestSIGTERMLetsHandlersFinish: it writes $SLOW_N
// events to each of three topics, and each handler prints "started
// <handler> <payload>" when it begins, holds, then writes its effect (with
// the time it committed) in its idempotency transaction. It exits 0 when
// Run returns nil after SIGTERM, 1 otherwise. Its database is
// $MILLWRIGHT_DATABASE_URL (migrated by the client); the transport comes
// from the environment (MILLWRIGHT_TRANSPORT, or sql on the database).
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	_ "github.com/millwright/millwright/transport/all"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "slowservice:", err)
		os.Exit(1)
	}
}

func run() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	hold, err := time.ParseDuration(os.Getenv("SLOW_HOLD"))
	if err != nil {
		return fmt.Errorf("SLOW_HOLD: %w", err)
	}
	n, err := strconv.Atoi(os.Getenv("SLOW_N"))
	if err != nil {
		return fmt.Errorf("SLOW_N: %w", err)
	}
	url := os.Getenv("MILLWRIGHT_DATABASE_URL")
	pool, err := postgres.OpenPgx(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS slow_effects (handler TEXT NOT NULL, id TEXT NOT NULL, done_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())`); err != nil {
		return err
	}
	db, name := postgres.Pgx(pool), os.Getenv("SLOW_NAME")
	c, err := millwright.NewClient(db, millwright.Config{Name: name, DatabaseURL: url, Migrate: true,
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slogLevel()}))})
	if err != nil {
		return err
	}
	handlers := []string{"slow1", "slow2", "slow3"}
	for _, h := range handlers {
		err := c.Handle(h, name+"."+h, func(ctx context.Context, tx postgres.Tx, msg *message.Message) error {
			fmt.Printf("started %s %s\n", h, msg.Payload)
			select {
			case <-time.After(hold):
			case <-ctx.Done():
				return ctx.Err()
			}
			_, err := tx.Pgx().Exec(ctx, `INSERT INTO slow_effects (handler, id) VALUES ($1, $2)`, h, string(msg.Payload))
			return err
		}, millwright.HandlerConfig{})
		if err != nil {
			return err
		}
	}
	go func() {
		select {
		case <-c.Running():
		case <-ctx.Done():
			return
		}
		err := db.InTx(ctx, func(tx postgres.Tx) error {
			for _, h := range handlers {
				for i := range n {
					id := strconv.Itoa(i)
					ev := outbox.Event{Topic: name + "." + h, AggregateType: "item", AggregateID: id, EventType: "slow.v1", Payload: []byte(id)}
					if err := c.Add(ctx, tx, ev); err != nil {
						return err
					}
				}
			}
			return nil
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "slowservice: writing events:", err)
		}
	}()
	return c.Run(ctx)
}

// slogLevel is $SLOW_LOG_LEVEL (debug, info, warn, error), default warn.
func slogLevel() slog.Level {
	var l slog.Level
	if err := l.UnmarshalText([]byte(os.Getenv("SLOW_LOG_LEVEL"))); err != nil {
		return slog.LevelWarn
	}
	return l
}
