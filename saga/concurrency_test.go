package saga_test

import (
	"context"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/outbox"
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
// (orchestrator instances): optimistic locking lets exactly one transition
// happen; the others are recorded as duplicates.
func TestConcurrentRepliesMakeOneTransition(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations())
	s.DB.SetMaxOpenConns(10)
	tp := newTopics()
	def := ordersDef(t, tp, defOpts{})
	ctx := context.Background()
	orchs := make([]*saga.Orchestrator[Order], 4)
	for i := range orchs {
		var err error
		orchs[i], err = saga.NewOrchestrator(s.DB, def, saga.Config{ReplyTopic: tp.replies})
		require.NoError(t, err)
	}
	tx, err := s.DB.Begin()
	require.NoError(t, err)
	require.NoError(t, orchs[0].Start(ctx, tx, "race", Order{ID: "race"}))
	require.NoError(t, tx.Commit())

	const n = 8
	cmd := commandFor("race", reserve, saga.PhaseForward, "1", tp.replies)
	start := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		typ := reserve + ".succeeded"
		if i%2 == 1 {
			typ = reserve + ".failed"
		}
		reply, err := saga.NewReply(cmd, typ, map[string]string{"ID": "r"})
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			errs <- orchs[i%len(orchs)].HandleReply(reply)
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	info, h, err := saga.Get(ctx, s.DB, "race")
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
