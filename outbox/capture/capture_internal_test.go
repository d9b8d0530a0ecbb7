package capture

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
)

// panicLog keeps the errors a logger was given.
type panicLog struct {
	watermill.NopLogger
	mu   sync.Mutex
	errs []string
}

func (l *panicLog) Error(msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	stack, _ := fields["stack"].(string)
	l.errs = append(l.errs, msg+": "+err.Error()+" slot="+fields["slot"].(string)+" stack="+stack)
}

// Issue 40 item 9: a round that panics is recovered, logged with its
// slot and counted; the tracker runs its next round.
func TestCaptureTrackerSurvivesAPanickingRound(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, outbox.Migrations())
	log := &panicLog{}
	reg := prometheus.NewRegistry()
	tr, err := NewTracker(postgres.From(s.DB), Config{Slot: "nosuch_" + s.Name, Interval: 10 * time.Millisecond, Logger: log, Registerer: reg})
	require.NoError(t, err)
	rounds := make(chan int, 10)
	n := 0
	tr.hook = func(*Round) {
		n++
		select {
		case rounds <- n:
		default:
		}
		if n == 1 {
			panic("a bad record")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- tr.Run(ctx) }()
	for r := range rounds {
		if r >= 2 {
			break
		}
	}
	require.NoError(t, tr.Close())
	require.NoError(t, <-done)
	require.EqualValues(t, 1, testutil.ToFloat64(tr.guard.Panics()), "the panic is counted")
	log.mu.Lock()
	defer log.mu.Unlock()
	require.NotEmpty(t, log.errs)
	require.Contains(t, log.errs[0], "recovered from a panic")
	require.Contains(t, log.errs[0], "a bad record")
	require.Contains(t, log.errs[0], "slot=nosuch_"+s.Name)
	require.True(t, strings.Contains(log.errs[0], "capture_internal_test.go"), "with the stack")
	if len(log.errs) > 1 {
		require.Contains(t, log.errs[1], "not registered", "the next round ran (and says what to do about the slot)")
	}
}
