package console_test

import (
	"context"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/postgres"
)

// operator is a second browser: its own cookies, token and name.
func (b *bundle) operator(t *testing.T, name string) (*bundle, string) {
	t.Helper()
	jar, _ := cookiejar.New(nil)
	o := *b
	o.client = &http.Client{Jar: jar, Timeout: 30 * time.Second, Transport: basicAuth{name}}
	return &o, o.token(t)
}

type basicAuth struct{ user string }

func (a basicAuth) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.SetBasicAuth(a.user, "x")
	return http.DefaultTransport.RoundTrip(r)
}

// waitBlocked waits until n console replays (dlq.ReplayTx's row lock)
// wait for the lock holder holds.
func waitBlocked(t *testing.T, b *bundle, holder, n int) {
	t.Helper()
	// Waiters queue behind each other: the second is blocked by the first.
	poll.Until(t, 20*time.Second, func() bool {
		return len(pgtest.Column[int](t, b.schema.DB, `WITH RECURSIVE w(pid) AS (
				SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))
				UNION SELECT a.pid FROM pg_stat_activity a JOIN w ON w.pid = ANY(pg_blocking_pids(a.pid)))
			SELECT pid FROM w JOIN pg_stat_activity USING (pid) WHERE query LIKE '%FROM millwright_dead_letters%FOR UPDATE%'`, holder)) == n
	}, "%d console update(s) blocked behind backend %d", n, holder)
}

// holdRow locks dead letter id in a transaction of its own and returns its
// backend pid and the release.
func holdRow(t *testing.T, b *bundle, id int64) (int, func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := b.schema.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	var pid int
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_backend_pid() FROM millwright_dead_letters WHERE id = $1 FOR UPDATE`, id).Scan(&pid))
	var once sync.Once
	release := func() { once.Do(func() { require.NoError(t, tx.Commit()) }) }
	t.Cleanup(release)
	return pid, release
}

// TestTwoOperatorsRacingOnOneDeadLetterSendExactlyOneMessage: two
// operators click at the same moment (both requests are made to wait on
// the row, then released together); whatever each clicked, exactly one
// message is queued, and the other is told it lost.
func TestTwoOperatorsRacingOnOneDeadLetterSendExactlyOneMessage(t *testing.T) {
	t.Parallel()
	pgtest.ForEachDriver(t, func(t *testing.T, driver string) {
		for _, c := range []struct {
			name         string
			alice, bobby url.Values
		}{
			{"EditAgainstEdit", url.Values{"encoding": {"text"}, "payload": {`{"by":"alice"}`}, "action": {"replay"}},
				url.Values{"encoding": {"text"}, "payload": {`{"by":"bob"}`}, "action": {"replay"}}},
			{"EditAgainstReplay", url.Values{"encoding": {"text"}, "payload": {`{"by":"alice"}`}, "action": {"replay"}},
				url.Values{"action": {"replay"}}},
		} {
			t.Run(c.name, func(t *testing.T) {
				t.Parallel()
				b := setupOn(t, driver)
				id := b.deadLetter(t, "race", "T", "boom", []byte(`{"by":"nobody"}`), nil)
				sid := strconv.FormatInt(id, 10)
				alice, at := b.operator(t, "alice")
				bob, bt := b.operator(t, "bob")
				holder, release := holdRow(t, b, id)

				paths := []string{"/dead-letters/" + sid + "/edit", "/dead-letters/" + sid + "/edit"}
				if c.bobby.Get("payload") == "" {
					paths[1] = "/dead-letters/replay"
					c.bobby.Set("id", sid)
				}
				bodies := make([]string, 2)
				var wg sync.WaitGroup
				for i, op := range []struct {
					b    *bundle
					tok  string
					form url.Values
				}{{alice, at, c.alice}, {bob, bt, c.bobby}} {
					wg.Add(1)
					go func() {
						defer wg.Done()
						status, body := op.b.post(t, paths[i], op.tok, op.form)
						if status != http.StatusOK {
							body = "status " + strconv.Itoa(status) + ": " + body
						}
						bodies[i] = body
					}()
				}
				waitBlocked(t, b, holder, 2)
				release()
				wg.Wait()

				queued := b.outboxPayloads(t, "race")
				require.Len(t, queued, 1, "exactly one message is queued: %v", queued)
				won := 0
				for _, body := range bodies {
					require.NotContains(t, body, "status ")
					if !strings.Contains(body, `id="skipped"`) {
						won++
					}
				}
				require.Equal(t, 1, won, "one operator wins, the other is told it lost")
				state := b.state(t, id)
				if queued[0] == `{"by":"nobody"}` {
					require.Equal(t, "replayed", state)
				} else {
					require.Equal(t, "superseded", state)
				}
				audited := pgtest.Column[string](t, b.schema.DB, `SELECT os_user FROM millwright_audit`)
				require.Len(t, audited, 1, "only the winner's action is recorded")
			})
		}
	})
}

// TestAnEditLosesToTheCLIsReplayInFlight: `millwright dlq replay`
// (dlq.Replay, one dlq.ReplayTx per row) holds the row while its
// transaction is open; an edit made meanwhile waits, then finds the row
// replayed and queues nothing.
func TestAnEditLosesToTheCLIsReplayInFlight(t *testing.T) {
	t.Parallel()
	b := setup(t)
	id := b.deadLetter(t, "cli-race", "T", "boom", []byte(`{"v":1}`), nil)
	tok := b.token(t)
	ctx := context.Background()
	tx, err := b.schema.DB.BeginTx(ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	_, err = dlq.ReplayTx(ctx, postgres.SQLTx(tx), id, dlq.ReplayOneOptions{By: audit.Operator{User: "cli"}})
	require.NoError(t, err)
	var holder int
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&holder))
	done := make(chan string, 1)
	go func() {
		_, body := b.post(t, "/dead-letters/"+strconv.FormatInt(id, 10)+"/edit", tok, url.Values{"encoding": {"text"}, "payload": {`{"v":2}`}, "action": {"replay"}})
		done <- body
	}()
	waitBlocked(t, b, holder, 1)
	require.NoError(t, tx.Commit())
	body := <-done
	require.Contains(t, body, "another operator replayed or edited it first")
	require.Equal(t, []string{`{"v":1}`}, b.outboxPayloads(t, "cli-race"), "the CLI's replay alone is queued")
	require.Equal(t, "replayed", b.state(t, id))
}
