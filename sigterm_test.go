package millwright_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgconntest"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/shutdown"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// SIGTERM while three handlers of 3 s each are in flight: the built
// service (testdata/slowservice, on the client with its default grace)
// lets them finish, their effects commit after the signal, and it exits
// 0 well within the grace. Counted from the database: every handler that
// started has its effect, once.
func TestSIGTERMLetsHandlersFinish(t *testing.T) {
	t.Parallel()
	bin := pgconntest.Build(t, "./testdata/slowservice")
	for _, kind := range []transport.Kind{transport.SQL, transport.Kafka, transport.AMQP} {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			schema := pgtest.New(t)
			name := "slow-" + strings.ToLower(watermill.NewShortUUID()[:8])
			env := append(os.Environ(), "MILLWRIGHT_DATABASE_URL="+schema.URL+"&pool_max_conns=10", // 8 handlers at once
				"SLOW_HOLD=3s", "SLOW_N=20", "SLOW_NAME="+name, "MILLWRIGHT_TRANSPORT=", shutdown.GraceEnv+"=")
			switch kind {
			case transport.SQL: // lib/pq refuses the URL's pool_max_conns
				env = append(env, "MILLWRIGHT_TRANSPORT=sql", "MILLWRIGHT_SQL_URL="+schema.URL)
			case transport.AMQP:
				env = append(env, "MILLWRIGHT_TRANSPORT=amqp", "MILLWRIGHT_AMQP_URL="+transporttest.AMQPURL())
				var topics, groups []string
				for _, h := range []string{"slow1", "slow2", "slow3"} {
					topics, groups = append(topics, name+"."+h), append(groups, name+"."+h)
				}
				transporttest.DeleteAMQPTopology(t, topics, groups...)
			case transport.Kafka:
				cfg := transporttest.Config(t, kind)
				env = append(env, "MILLWRIGHT_TRANSPORT=kafka", "MILLWRIGHT_KAFKA_BROKERS="+strings.Join(cfg.Kafka.Brokers, ","))
			}
			cmd := exec.Command(bin)
			cmd.Env = env
			stderr := &lockedBuffer{}
			cmd.Stderr = stderr
			stdout, err := cmd.StdoutPipe()
			require.NoError(t, err)
			require.NoError(t, cmd.Start())
			t.Cleanup(func() { _ = cmd.Process.Kill() })
			type line struct {
				handler, id string
				at          time.Time // when the test read it
			}
			lines := make(chan line, 1000)
			go func() {
				defer close(lines)
				for sc := bufio.NewScanner(stdout); sc.Scan(); {
					if f := strings.Fields(sc.Text()); len(f) == 3 && f[0] == "started" {
						lines <- line{f[1], f[2], time.Now()}
					}
				}
			}()

			// Wait until three messages are in flight: started less than
			// 2 s ago, they hold for 3 s.
			var started []line
			inFlight := func(at time.Time) (n int) {
				for _, l := range started {
					if at.Sub(l.at) < 2*time.Second {
						n++
					}
				}
				return n
			}
			deadline := time.After(3 * time.Minute)
			for inFlight(time.Now()) < 3 {
				select {
				case l, ok := <-lines:
					if !ok {
						t.Fatalf("the service exited before its handlers started: %s", stderr)
					}
					started = append(started, l)
				case <-deadline:
					t.Fatalf("three handlers were not in flight together within 3 minutes; stderr: %s", stderr)
				}
			}
			signalled := time.Now()
			require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
			waited := make(chan error, 1)
			go func() {
				for l := range lines { // messages the handlers started after the signal, if any
					started = append(started, l)
				}
				waited <- cmd.Wait()
			}()
			select {
			case err = <-waited:
			case <-time.After(shutdown.DefaultServiceGrace + 10*time.Second):
				t.Fatalf("the service still runs %s after SIGTERM; stderr: %s", time.Since(signalled), stderr)
			}
			took := time.Since(signalled)
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				t.Fatalf("exit status %d after SIGTERM (want 0); stderr: %s", exit.ExitCode(), stderr)
			}
			require.NoError(t, err)
			require.Less(t, took, shutdown.DefaultServiceGrace, "exit after the signal took longer than the default grace")
			t.Logf("%d handlers in flight at SIGTERM; exit 0 after %s", inFlight(signalled), took.Round(time.Millisecond))

			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			for _, l := range started {
				var n int
				var done time.Time
				require.NoError(t, schema.DB.QueryRowContext(ctx, `SELECT count(*), coalesce(max(done_at), 'epoch') FROM slow_effects WHERE handler = $1 AND id = $2`, l.handler, l.id).Scan(&n, &done))
				require.Equal(t, 1, n, "effects of %s %s, which started (%s)", l.handler, l.id, stderr)
				if signalled.Sub(l.at) < 2*time.Second && !l.at.After(signalled) {
					require.True(t, done.After(signalled), "%s %s, in flight at the signal, committed at %s, before the signal at %s", l.handler, l.id, done, signalled)
				}
			}
			var total int
			require.NoError(t, schema.DB.QueryRowContext(ctx, `SELECT count(*) FROM slow_effects`).Scan(&total))
			require.Equal(t, len(started), total, "effects of handlers that never said they started")
		})
	}
}

// lockedBuffer is a bytes.Buffer the child's stderr copier and the test
// share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
