package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
)

// Run on a schema without the saga tables fails at once, naming the
// table and the fix (before, it logged the failed claim every
// PollInterval and went on).
func TestOrchestrator_RunWithoutMigrationsFailsAtOnce(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t) // no migrations
	def := saga.MustDefine("x", saga.Step[struct{}]{Name: "s", Command: func(struct{}) (saga.Command, error) { return saga.Command{Topic: "t"}, nil }, NoCompensation: true})
	o, err := saga.NewOrchestrator(postgres.From(s.DB), def, saga.Config{ReplyTopic: "x.replies", PollInterval: 10 * time.Millisecond})
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() { errc <- o.Run(context.Background()) }()
	select {
	case err = <-errc:
	case <-time.After(10 * time.Second):
		require.NoError(t, o.Close())
		t.Fatalf("Run on a schema without migrations was still running after 10s; it returned %v once closed", <-errc)
	}
	for _, want := range []string{"millwright_saga_instances", "millwright migrate", s.Name} {
		require.ErrorContains(t, err, want)
	}
	require.NoError(t, o.Close())
}
