package saga_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/millwright/millwright/idempotency"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// The saga steps' spans go to Config.TracerProvider, not to the global
// provider (which this test leaves alone).
func TestConfigTracerProviderRecordsSagaSteps(t *testing.T) {
	t.Parallel()
	exp := tracetest.NewInMemoryExporter()
	b := setup(t, nil, defOpts{})
	b.tracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	o := b.startOrchestrator(t)
	b.start(t, o, "traced-1")
	b.waitState(t, "traced-1", saga.StateCompleted)

	var steps []string
	for _, s := range exp.GetSpans() {
		if strings.HasPrefix(s.Name, "saga step ") {
			steps = append(steps, s.Name)
		}
	}
	require.Len(t, steps, 3, "one span per reply handled (three steps), got %v", steps)
}

func TestOrchestratorLifecycle(t *testing.T) {
	t.Parallel()
	schema := pgtest.New(t, outbox.Migrations(), idempotency.Migrations(), saga.Migrations())
	def := ordersDef(t, newTopics(), defOpts{})
	newOrch := func() *saga.Orchestrator[Order] {
		o, err := saga.NewOrchestrator(postgres.From(schema.DB), def, saga.Config{PollInterval: time.Hour})
		require.NoError(t, err)
		return o
	}

	o := newOrch()
	errc := make(chan error, 1)
	go func() { errc <- o.Run(context.Background()) }()
	select {
	case <-o.Running():
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not start")
	}
	require.ErrorContains(t, o.Run(context.Background()), "saga.Orchestrator: Run called twice")
	require.NoError(t, o.Close())
	// Close waited for the loop (internal/runner's tests prove the order);
	// Run's return reaches errc a moment later.
	select {
	case err := <-errc:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return within 30s of Close")
	}
	require.NoError(t, o.Close(), "Close is idempotent")

	closedFirst := newOrch()
	require.NoError(t, closedFirst.Close(), "Close before Run")
	require.NoError(t, closedFirst.Run(context.Background()), "Run after Close returns at once")

	_, err := saga.NewOrchestrator(postgres.From(schema.DB), def, saga.Config{PollInterval: -1, BatchSize: -1, CloseTimeout: -1})
	for _, field := range []string{"PollInterval", "BatchSize", "CloseTimeout"} {
		require.ErrorContains(t, err, "Config."+field, "every field error is reported")
	}
}
