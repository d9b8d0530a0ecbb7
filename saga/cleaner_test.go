package saga_test

import (
	"context"
	"testing"
	"time"

	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retention"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/saga"
)

// newCleaner builds the cleaner on the pool of driver.
func newCleaner(t *testing.T, s *pgtest.Schema, driver string, cfg retention.Config) (*retention.Cleaner, error) {
	t.Helper()
	return retention.NewSagaCleaner(s.Handles(t, driver), cfg)
}

func TestCleanerDeletesOldFinishedSagasWithTheirSteps(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		t.Parallel()
		testCleanerDeletesOldFinishedSagas(t, driver)
	})
}

func testCleanerDeletesOldFinishedSagas(t *testing.T, driver string) {
	s := pgtest.New(t, saga.Migrations())
	// One saga per state, finished 31 days ago, and one completed today.
	_, err := s.DB.Exec(`INSERT INTO millwright_saga_instances (id, type, state, data, updated_at)
		SELECT st, 'orders', st, '{}', now() - interval '31 days'
		FROM unnest(ARRAY['running', 'compensating', 'completed', 'compensated', 'stuck']) st;
		INSERT INTO millwright_saga_instances (id, type, state, data) VALUES ('completed-today', 'orders', 'completed', '{}');
		INSERT INTO millwright_saga_steps (saga_id, step, kind) SELECT id, 's', 'command' FROM millwright_saga_instances`)
	require.NoError(t, err)

	c, err := newCleaner(t, s, driver, retention.Config{})
	require.NoError(t, err)
	require.Equal(t, retention.DefaultSagaRetention, c.Config().Retention)
	n, err := c.Count(context.Background())
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	stats, err := c.RunOnce(context.Background())
	require.NoError(t, err)
	require.Equal(t, retention.Stats{Deleted: 2, Batches: 1}, stats)

	var left, steps string
	require.NoError(t, s.DB.QueryRow(`SELECT string_agg(id, ',' ORDER BY id) FROM millwright_saga_instances`).Scan(&left))
	require.Equal(t, "compensating,completed-today,running,stuck", left, "unfinished and recent sagas are kept")
	require.NoError(t, s.DB.QueryRow(`SELECT string_agg(saga_id, ',' ORDER BY saga_id) FROM millwright_saga_steps`).Scan(&steps))
	require.Equal(t, left, steps, "the steps of deleted sagas went with them")

	plan := pgtest.Plan(t, s.DB, `SELECT id FROM millwright_saga_instances
		WHERE state IN ('completed', 'compensated') AND updated_at < now() - interval '30 days' ORDER BY updated_at LIMIT 1000`)
	require.Contains(t, plan, "millwright_saga_instances_finished_idx", "the batch walks the index of migration 003")

	_, err = retention.NewSagaCleaner(postgres.From(s.DB), retention.Config{Retention: time.Second, BatchSize: -1})
	require.ErrorContains(t, err, "saga cleaner: retention.Config.Retention 1s is too short")
	require.ErrorContains(t, err, "retention.Config.BatchSize -1", "every field error, joined")
}
