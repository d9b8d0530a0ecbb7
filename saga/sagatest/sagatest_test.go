package sagatest_test

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/saga/sagatest"
)

func TestWaitState(t *testing.T) {
	t.Parallel()
	s := pgtest.New(t, saga.Migrations())
	s.DB.SetMaxOpenConns(2)
	_, err := s.DB.Exec(`INSERT INTO millwright_saga_instances (id, type, state, data) VALUES ('s-1', 'x', 'running', '{}')`)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = sagatest.WaitState(ctx, postgres.From(s.DB), "s-1", saga.StateCompleted)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.ErrorContains(t, err, `saga "s-1" is running`)

	// The saga completes only after WaitState has read it running and
	// polled again: the waiting path, not a first read that matches.
	db := &countingDB{polledTwice: make(chan struct{})}
	connector, err := postgres.NewConnector(s.URL)
	require.NoError(t, err)
	db.DB = sql.OpenDB(countingConnector{connector, db})
	t.Cleanup(func() { _ = db.Close() })
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		info, err := sagatest.WaitState(ctx, postgres.SQL(db.DB), "s-1", saga.StateCompleted)
		if err == nil && info.State != saga.StateCompleted {
			err = context.Canceled
		}
		done <- err
	}()
	select {
	case <-db.polledTwice:
	case err := <-done:
		t.Fatalf("WaitState returned before the saga completed: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("WaitState did not poll twice within 10s")
	}
	_, err = s.DB.Exec(`UPDATE millwright_saga_instances SET state = 'completed' WHERE id = 's-1'`)
	require.NoError(t, err)
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("WaitState did not return within 10s of the saga completing")
	}

	ctx2, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	_, err = sagatest.WaitState(ctx2, postgres.From(s.DB), "missing", saga.StateCompleted)
	require.ErrorContains(t, err, "never read")
}

// countingDB counts the instance reads (one query of
// millwright_saga_instances per poll; the history is another query) and
// closes polledTwice when the second starts: the first read has found the
// saga not yet in the wanted state and WaitState has waited a tick.
type countingDB struct {
	*sql.DB
	polls       atomic.Int32
	polledTwice chan struct{}
}

func (d *countingDB) saw(query string) {
	if strings.Contains(query, "FROM millwright_saga_instances") && d.polls.Add(1) == 2 {
		close(d.polledTwice)
	}
}

// countingConnector counts the queries of its connections (WaitState
// takes a postgres.DB, so the count is taken below database/sql).
type countingConnector struct {
	driver.Connector
	d *countingDB
}

func (c countingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return countingConn{conn, c.d}, nil
}

type countingConn struct {
	driver.Conn
	d *countingDB
}

func (c countingConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	c.d.saw(query)
	q, ok := c.Conn.(driver.QueryerContext)
	if !ok {
		return nil, driver.ErrSkip
	}
	return q.QueryContext(ctx, query, args)
}
