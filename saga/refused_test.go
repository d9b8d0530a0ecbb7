package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

type refusedData struct {
	ID   string
	Note string
	Big  bool
}

// oversized is a payload outbox.Add refuses: one byte past the transport
// limit it checks events against.
func oversized() []byte { return make([]byte, outbox.DefaultMaxEventBytes+1) }

// refusedDef is a two-step saga whose commands outbox.Add refuses for some
// instances: the first step's compensation of a saga whose id starts with
// "huge", the second step's command once the first step's success reply
// said "big"; the compensation of a saga whose id starts with "utf" has a
// type that is not valid UTF-8, and that of "errtext" fails with an error
// whose text is not. The first step's OnSuccess copies any other reply payload
// into Note.
func refusedDef(t *testing.T) *saga.Definition[refusedData] {
	t.Helper()
	def, err := saga.Define("refused",
		saga.Step[refusedData]{
			Name: "first",
			Command: func(d refusedData) (saga.Command, error) {
				return saga.Command{Topic: "refused.first", Type: "first.v1", Payload: d}, nil
			},
			OnSuccess: func(d *refusedData, r saga.Reply) error {
				if string(r.Payload) == "big" {
					d.Big = true
				} else {
					d.Note = string(r.Payload)
				}
				return nil
			},
			Compensation: func(d refusedData) (saga.Command, error) {
				if strings.HasPrefix(d.ID, "bignum") {
					return saga.Command{Topic: "refused.first", Type: "first.undo.v1", Payload: json.RawMessage(`{"n":1e131072,"s":"\ud800"}`)}, nil
				}
				if strings.HasPrefix(d.ID, "errtext") {
					return saga.Command{}, errors.New("participant said \xff\x00")
				}
				if strings.HasPrefix(d.ID, "utf") {
					return saga.Command{Topic: "refused.first", Type: "first.undo\xff", Payload: d}, nil
				}
				if strings.HasPrefix(d.ID, "huge") {
					return saga.Command{Topic: "refused.first", Type: "first.undo.v1", Payload: oversized()}, nil
				}
				return saga.Command{Topic: "refused.first", Type: "first.undo.v1", Payload: d}, nil
			},
			Timeout: time.Hour, CompensationTimeout: time.Hour,
		},
		saga.Step[refusedData]{
			Name: "second",
			Command: func(d refusedData) (saga.Command, error) {
				if d.Big {
					return saga.Command{Topic: "refused.second", Type: "second.v1", Payload: oversized()}, nil
				}
				return saga.Command{Topic: "refused.second", Type: "second.v1", Payload: d}, nil
			},
			NoCompensation: true, Timeout: time.Hour,
		},
	)
	require.NoError(t, err)
	return def
}

// refusedBundle is an orchestrator of refusedDef on one driver.
type refusedBundle struct {
	schema *pgtest.Schema
	pgx    *pgxpool.Pool // nil on pq
	o      *saga.Orchestrator[refusedData]
	reg    *prometheus.Registry
	dedup  *idempotency.Middleware
}

func setupRefused(t *testing.T, driver string) *refusedBundle {
	t.Helper()
	b := &refusedBundle{schema: pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations()), reg: prometheus.NewRegistry()}
	cfg := saga.Config{Registerer: b.reg}
	var err error
	var store *idempotency.PostgresStore
	if driver == pgtest.DriverPgx {
		b.pgx = b.schema.Pgx(t)
		b.o, err = saga.NewOrchestrator(postgres.From(b.pgx), refusedDef(t), cfg)
		require.NoError(t, err)
		store, err = idempotency.NewPostgresStore(postgres.From(b.pgx))
	} else {
		b.o, err = saga.NewOrchestrator(postgres.From(b.schema.DB), refusedDef(t), cfg)
		require.NoError(t, err)
		store, err = idempotency.NewPostgresStore(postgres.From(b.schema.DB))
	}
	require.NoError(t, err)
	b.dedup, err = idempotency.NewMiddleware(store, idempotency.Config{Consumer: "refused-saga", Registerer: b.reg})
	require.NoError(t, err)
	return b
}

func (b *refusedBundle) handle() postgres.Handle {
	if b.pgx != nil {
		return postgres.From(b.pgx)
	}
	return postgres.From(b.schema.DB)
}

func (b *refusedBundle) start(t *testing.T, id string, d refusedData) error {
	t.Helper()
	ctx := context.Background()
	if b.pgx != nil {
		tx, err := b.pgx.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		if err := b.o.Start(ctx, postgres.PgxTx(tx), id, d); err != nil {
			return err
		}
		require.NoError(t, tx.Commit(ctx))
		return nil
	}
	tx, err := b.schema.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	if err := b.o.Start(ctx, postgres.SQLTx(tx), id, d); err != nil {
		return err
	}
	require.NoError(t, tx.Commit())
	return nil
}

// commands counts saga id's outbox rows of event type typ: what the relay
// would publish.
func (b *refusedBundle) commands(t *testing.T, id, typ string) int {
	t.Helper()
	var n int
	require.NoError(t, b.schema.DB.QueryRow(`SELECT count(*) FROM millwright_outbox WHERE aggregate_id = $1 AND event_type = $2`, id, typ).Scan(&n))
	return n
}

func (b *refusedBundle) get(t *testing.T, id string) (saga.Info, []saga.HistoryEntry) {
	t.Helper()
	info, h, err := saga.Get(context.Background(), b.handle(), id)
	require.NoError(t, err)
	return info, h
}

// reply is a success reply to step first of saga id, handled as the
// router would: behind the idempotency middleware, in its transaction.
func (b *refusedBundle) reply(id, payload string) error {
	m := message.NewMessage(watermill.NewUUID(), []byte(payload))
	for k, v := range map[string]string{metadata.SagaID: id, metadata.SagaType: "refused", metadata.SagaStep: "first",
		metadata.SagaPhase: saga.PhaseForward, metadata.SagaAttempt: "1", metadata.SagaReplyType: "first.succeeded"} {
		m.Metadata.Set(k, v)
	}
	m.Metadata.Set(metadata.EventID, m.UUID)
	m.SetContext(context.Background())
	_, err := b.dedup.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		return nil, b.o.HandleReply(msg)
	})(m)
	return err
}

// One saga whose compensation the outbox refuses (its payload is past
// the transport's size limit) must not stop the deadlines of its saga
// type: it is set aside as stuck, naming the refused command and the fix,
// and the other overdue saga's timeout fires in the same round. Before,
// the refusal failed the whole batch, and the next round claimed the same
// (oldest) saga first again: no timeout nor compensation of that type
// fired any more.
func TestRunSetsAsideAnInstanceWhoseCommandTheOutboxRefuses(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		ctx := context.Background()
		b := setupRefused(t, driver)
		require.NoError(t, b.start(t, "huge", refusedData{ID: "huge"}))
		require.NoError(t, b.start(t, "good", refusedData{ID: "good"}))
		// Both overdue; the refused one first, as the round claims them.
		_, err := b.schema.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = now() - CASE id WHEN 'huge' THEN interval '2 seconds' ELSE interval '1 second' END`)
		require.NoError(t, err)

		n, err := b.o.RunOnce(ctx)
		require.NoError(t, err, "one refused command fails the round of every saga of the type")
		require.Equal(t, 2, n)

		good, _ := b.get(t, "good")
		require.Equal(t, saga.StateCompensating, good.State, "%+v", good)
		require.Equal(t, 1, b.commands(t, "good", "first.undo.v1"), "the other saga's compensation is in the outbox")

		huge, h := b.get(t, "huge")
		require.Equal(t, saga.StateStuck, huge.State, "%+v", huge)
		require.True(t, huge.Deadline.IsZero(), "a set-aside saga is not fired again")
		require.Contains(t, huge.LastError, `step "first" timed out`, "the cause is kept")
		require.Contains(t, huge.LastError, `set aside: the outbox refused the compensation command "first.undo.v1" of step "first" (topic "refused.first", `)
		require.Contains(t, huge.LastError, "outbox.DefaultMaxEventBytes")
		require.Contains(t, huge.LastError, "millwright saga resolve huge")
		require.Zero(t, b.commands(t, "huge", "first.undo.v1"), "nothing is sent for the refused saga")
		require.Equal(t, saga.KindStuck, h[len(h)-1].Kind, "%+v", h)
		require.Equal(t, saga.KindTimeout, h[len(h)-2].Kind, "the timeout is recorded, the unsent compensation is not: %+v", h)
		require.Zero(t, huge.CompensationAttempts, "no compensation attempt was sent")
		require.Equal(t, 1.0, metricValue(t, b.reg, saga.MetricStuck, map[string]string{"type": "refused"}))

		// The next round does not claim it again.
		n, err = b.o.RunOnce(ctx)
		require.NoError(t, err)
		require.Zero(t, n, "the refused saga is not retried every round")

		// Resolved, it is tried again (and set aside again while the
		// command is still refused), and nothing else is held.
		if b.pgx != nil {
			_, err = saga.Resolve(ctx, postgres.From(b.pgx), "huge", saga.ResolveRetry, "", false)
		} else {
			_, err = saga.Resolve(ctx, postgres.From(b.schema.DB), "huge", saga.ResolveRetry, "", false)
		}
		require.NoError(t, err)
		n, err = b.o.RunOnce(ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		huge, _ = b.get(t, "huge")
		require.Equal(t, saga.StateStuck, huge.State)
	})
}

// A reply whose transition the outbox refuses (the next step's command is
// past the transport's size limit) sets the saga aside as stuck and is
// acknowledged: the reply is recorded (its redelivery is a duplicate), the
// data its OnSuccess made is kept for the compensations, and the reason
// names the reply, the refused command and the fix. Before, HandleReply
// returned the refusal as a transient error: the reply was redelivered
// forever and the saga waited.
func TestReplyWhoseCommandTheOutboxRefusesSetsTheSagaAside(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupRefused(t, driver)
		require.NoError(t, b.start(t, "s1", refusedData{ID: "s1"}))
		require.NoError(t, b.reply("s1", "big"), "the reply is acknowledged")

		info, h := b.get(t, "s1")
		require.Equal(t, saga.StateStuck, info.State, "%+v", info)
		require.Contains(t, info.LastError, `set aside: reply first.succeeded to step "first" (attempt 1): the outbox refused the forward command "second.v1" of step "second" (topic "refused.second", `)
		require.Contains(t, info.LastError, "millwright saga resolve s1")
		require.JSONEq(t, `{"ID":"s1","Note":"","Big":true}`, string(info.Data), "the reply's data is kept")
		require.Zero(t, b.commands(t, "s1", "second.v1"))
		kinds := []string{}
		for _, e := range h {
			kinds = append(kinds, e.Step+"/"+e.Kind)
		}
		require.Equal(t, []string{"first/" + saga.KindCommand, "first/" + saga.KindReply, "second/" + saga.KindStuck}, kinds)

		// Redelivered (a new message: the broker's copy after a crash),
		// it is a duplicate, not a late success.
		require.NoError(t, b.reply("s1", "big"))
		info, h = b.get(t, "s1")
		require.Equal(t, saga.StateStuck, info.State)
		require.Equal(t, saga.KindDuplicate, h[len(h)-1].Kind, "%+v", h)
		require.Zero(t, b.commands(t, "s1", "first.undo.v1"))
	})
}

// Saga data jsonb cannot hold (a NUL character, which encoding/json
// writes as \u0000) is refused at the boundary naming the field: Start
// returns ErrDataNotStorable, and a reply whose OnSuccess copies a NUL
// into the data sets the saga aside with that reason and is acknowledged,
// the data as it was. Before, Postgres refused the write (22P05) and
// HandleReply returned it as a transient error on every redelivery;
// Start's error said to run `millwright migrate`.
func TestSagaDataPostgresCannotHoldIsRefusedNamingTheField(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupRefused(t, driver)
		err := b.start(t, "bad", refusedData{ID: "bad", Note: "a\x00b"})
		require.ErrorIs(t, err, saga.ErrDataNotStorable)
		require.Contains(t, err.Error(), `$.Note holds the escape \u0000 (a NUL character)`)
		require.NotContains(t, err.Error(), "migrate")

		require.NoError(t, b.start(t, "s2", refusedData{ID: "s2", Note: "before"}))
		require.NoError(t, b.reply("s2", "a\x00b"), "the reply is acknowledged")
		info, h := b.get(t, "s2")
		require.Equal(t, saga.StateStuck, info.State, "%+v", info)
		require.Contains(t, info.LastError, `set aside: reply first.succeeded to step "first" (attempt 1): its new data cannot be stored; fix the step's OnSuccess`)
		require.Contains(t, info.LastError, `$.Note holds the escape \u0000`)
		require.JSONEq(t, `{"ID":"s2","Note":"before","Big":false}`, string(info.Data))
		require.Equal(t, saga.KindStuck, h[len(h)-1].Kind, "%+v", h)
		require.Zero(t, b.commands(t, "s2", "second.v1"))
		require.Equal(t, 1.0, metricValue(t, b.reg, saga.MetricStuck, map[string]string{"type": "refused"}))
	})
}

// A command whose type is not valid UTF-8 (Postgres text refuses it,
// 22021, on both drivers) is a command that cannot be built, as one
// without a topic: the compensation fails and is retried after its
// backoff, with the reason; the other overdue saga's timeout fires in the
// same round. Before, the database refused the round's whole batch, every
// round: no deadline of the saga type fired any more.
func TestRunFiresDeadlinesPastACommandTypePostgresCannotStore(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupRefused(t, driver)
		require.NoError(t, b.start(t, "utf", refusedData{ID: "utf"}))
		require.NoError(t, b.start(t, "good", refusedData{ID: "good"}))
		_, err := b.schema.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = now() - CASE id WHEN 'utf' THEN interval '2 seconds' ELSE interval '1 second' END`)
		require.NoError(t, err)

		n, err := b.o.RunOnce(context.Background())
		require.NoError(t, err)
		require.Equal(t, 2, n)
		good, _ := b.get(t, "good")
		require.Equal(t, saga.StateCompensating, good.State)
		require.Equal(t, 1, b.commands(t, "good", "first.undo.v1"))
		bad, _ := b.get(t, "utf")
		require.Equal(t, saga.StateCompensating, bad.State, "%+v", bad)
		require.False(t, bad.AwaitingReply, "nothing was sent")
		require.Contains(t, bad.LastError, `building command: command Type "first.undo\xff" is not valid UTF-8`)
	})
}

// What every command or history row of a saga type carries is checked
// once, when it is defined or configured, rather than refused by Postgres
// on every transition: reply types (history rows) must be text, and
// Config.Source (every command's CloudEvents source) a URI-reference.
func TestDefinitionAndConfigRefuseWhatEveryTransitionWouldFailOn(t *testing.T) {
	t.Parallel()
	cmd := func(refusedData) (saga.Command, error) { return saga.Command{Topic: "x", Type: "x.v1"}, nil }
	_, err := saga.Define("text", saga.Step[refusedData]{Name: "a", Command: cmd, NoCompensation: true, SuccessReply: "a.ok\xff"})
	require.ErrorContains(t, err, `reply type "a.ok\xff" is not valid UTF-8 or holds a NUL byte`)
	_, err = saga.Define("text", saga.Step[refusedData]{Name: "a", Command: cmd, NoCompensation: true, FailureReply: "a.\x00"})
	require.ErrorContains(t, err, "holds a NUL byte")

	schema := pgtest.New(t, outbox.Migrations(), saga.Migrations())
	def, err := saga.Define("text", saga.Step[refusedData]{Name: "a", Command: cmd, NoCompensation: true})
	require.NoError(t, err)
	for _, src := range []string{"/orders\xff", "/orders\x00", "http://[::1"} {
		_, err = saga.NewOrchestrator(postgres.From(schema.DB), def, saga.Config{Source: src})
		require.ErrorContains(t, err, "Config.Source", "%q", src)
	}
	_, err = saga.NewOrchestrator(postgres.From(schema.DB), def, saga.Config{Source: "/orders-service"})
	require.NoError(t, err)
}

// A Command function's error is quoted in last_error and the history:
// text Postgres refuses (invalid UTF-8, a NUL byte) is stored with
// U+FFFD in their place. Before, the database refused the round's whole
// batch, every round.
func TestRunStoresACommandErrorWhoseTextPostgresRefuses(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupRefused(t, driver)
		require.NoError(t, b.start(t, "errtext", refusedData{ID: "errtext"}))
		require.NoError(t, b.start(t, "good", refusedData{ID: "good"}))
		_, err := b.schema.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = now() - CASE id WHEN 'errtext' THEN interval '2 seconds' ELSE interval '1 second' END`)
		require.NoError(t, err)

		n, err := b.o.RunOnce(context.Background())
		require.NoError(t, err)
		require.Equal(t, 2, n)
		require.Equal(t, 1, b.commands(t, "good", "first.undo.v1"))
		bad, h := b.get(t, "errtext")
		require.Equal(t, saga.StateCompensating, bad.State, "%+v", bad)
		require.Contains(t, bad.LastError, "building command: participant said \ufffd\ufffd")
		require.Contains(t, h[len(h)-1].Error, "participant said \ufffd\ufffd", "%+v", h)
	})
}

// A command payload that is valid JSON but that jsonb refuses (a number
// beyond numeric, a lone surrogate escape) is stored byte for byte, as
// the outbox stores one with \u0000, and published unchanged. Before, the
// outbox sent it to its jsonb column and the database refused the
// round's whole batch, every round.
func TestRunSendsACommandPayloadJSONBRefusesByteForByte(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		b := setupRefused(t, driver)
		require.NoError(t, b.start(t, "bignum", refusedData{ID: "bignum"}))
		require.NoError(t, b.start(t, "good", refusedData{ID: "good"}))
		_, err := b.schema.DB.Exec(`UPDATE millwright_saga_instances SET deadline_at = now() - CASE id WHEN 'bignum' THEN interval '2 seconds' ELSE interval '1 second' END`)
		require.NoError(t, err)

		n, err := b.o.RunOnce(context.Background())
		require.NoError(t, err)
		require.Equal(t, 2, n)
		require.Equal(t, 1, b.commands(t, "good", "first.undo.v1"))
		require.Equal(t, 1, b.commands(t, "bignum", "first.undo.v1"))
		var raw []byte
		require.NoError(t, b.schema.DB.QueryRow(`SELECT payload_raw FROM millwright_outbox WHERE aggregate_id = 'bignum' AND event_type = 'first.undo.v1'`).Scan(&raw))
		require.Equal(t, `{"n":1e131072,"s":"\ud800"}`, string(raw))
	})
}
