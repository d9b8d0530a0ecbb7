package saga_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// commandFor fakes the command message of a step, as a participant gets it.
func commandFor(id, step, phase, attempt, replyTo string) *message.Message {
	m := message.NewMessage("cmd-"+id, []byte(`{}`))
	m.Metadata.Set(metadata.SagaID, id)
	m.Metadata.Set(metadata.SagaType, "orders")
	m.Metadata.Set(metadata.SagaStep, step)
	m.Metadata.Set(metadata.SagaPhase, phase)
	m.Metadata.Set(metadata.SagaAttempt, attempt)
	m.Metadata.Set(metadata.SagaReplyTo, replyTo)
	return m
}

// Many different replies to one command race on several connections
// (orchestrator instances): the instance's row lock and its version let
// exactly one transition happen; the others are recorded as duplicates.
// The test holds the row lock until every reply waits on it, so all of
// them contend: one goes first, the others read the row it left.
func TestConcurrentRepliesMakeOneTransition(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations())
	tp := newTopics()
	def := ordersDef(t, tp, defOpts{})
	ctx := context.Background()

	const n = 8
	// One orchestrator instance per reply, each on a one-connection pool:
	// its backend pid identifies the instance's session.
	orchs := make([]*saga.Orchestrator[Order], n)
	pids := make([]int, n)
	for i := range orchs {
		db, err := sql.Open("postgres", s.URL)
		require.NoError(t, err)
		db.SetMaxOpenConns(1)
		t.Cleanup(func() { db.Close() })
		require.NoError(t, db.QueryRow(`SELECT pg_backend_pid()`).Scan(&pids[i]))
		orchs[i], err = saga.NewOrchestrator(postgres.From(db), def, saga.Config{ReplyTopic: tp.replies})
		require.NoError(t, err)
	}
	tx, err := s.DB.Begin()
	require.NoError(t, err)
	require.NoError(t, orchs[0].Start(ctx, postgres.SQLTx(tx), "race", Order{ID: "race"}))
	require.NoError(t, tx.Commit())

	lock, err := s.DB.Begin()
	require.NoError(t, err)
	t.Cleanup(func() { _ = lock.Rollback() })
	_, err = lock.Exec(`SELECT 1 FROM millwright_saga_instances WHERE id = 'race' FOR UPDATE`)
	require.NoError(t, err)

	cmd := commandFor("race", reserve, saga.PhaseForward, "1", tp.replies)
	errs := make(chan error, n)
	for i := range n {
		typ := reserve + ".succeeded"
		if i%2 == 1 {
			typ = reserve + ".failed"
		}
		reply, err := saga.NewReply(cmd, typ, map[string]string{"ID": "r"})
		require.NoError(t, err)
		go func() { errs <- orchs[i].HandleReply(reply) }()
	}
	poll.Until(t, 30*time.Second, func() bool { return pgtest.WaitingOnLock(t, s.DB, pids...) == n },
		"all %d replies wait on the instance's row lock", n)
	require.NoError(t, lock.Rollback())

	timeout := time.After(30 * time.Second)
	for i := range n {
		select {
		case err := <-errs:
			require.NoError(t, err)
		case <-timeout:
			t.Fatalf("timed out after 30s: %d of %d replies handled", i, n)
		}
	}

	info, h, err := saga.Get(ctx, postgres.From(s.DB), "race")
	require.NoError(t, err)
	require.EqualValues(t, 2, info.Version, "one transition")
	kinds := map[string]int{}
	for _, e := range h {
		kinds[e.Kind]++
	}
	require.Equal(t, 1, kinds[saga.KindReply], "%v", historyKinds(h))
	require.Equal(t, n-1, kinds[saga.KindDuplicate], "%v", historyKinds(h))
	var commands int
	require.NoError(t, s.DB.QueryRow(`SELECT count(*) FROM millwright_outbox`).Scan(&commands))
	if h[1].Detail == reserve+".succeeded" {
		require.Equal(t, saga.StateRunning, info.State)
		require.Equal(t, 2, commands, "the first command and one charge command")
	} else {
		// Step 0 failed: nothing to compensate.
		require.Equal(t, saga.StateCompensated, info.State)
		require.Equal(t, 1, commands, "only the first command")
	}
}
