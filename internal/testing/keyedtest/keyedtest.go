// Package keyedtest is the broker-independent harness of the key-parallel
// consumer tests in transport/kafka and transport/amqp: the messages'
// names (Ref, "key:seq" payloads), the Ledger that judges what a
// deduplicating consumer sees (reorders, duplicates, concurrency), and a
// child consumer process (StartChild re-executes the test binary, whose
// RunChild prints "done key:seq" as each handler finishes) that a test
// can SIGKILL with handlers running.
package keyedtest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

// Ref names one published message: its key and its place among the key's.
type Ref struct {
	Key string
	Seq int
}

// String is the message's payload, "key:seq".
func (r Ref) String() string { return r.Key + ":" + strconv.Itoa(r.Seq) }

// ParseRef reads a "key:seq" payload.
func ParseRef(s string) (Ref, bool) {
	k, seq, ok := strings.Cut(s, ":")
	n, err := strconv.Atoi(seq)
	return Ref{k, n}, ok && err == nil
}

// Ledger is the shared view of what every consumer's handlers did, as a
// deduplicating consumer sees it: each message's first application must
// come after its key's previous message finished, and no two messages of
// a key may run at once anywhere. It counts reorders and duplicates (a
// message run again after it finished: allowed, at least once). Hold Mu
// to read its fields while handlers run.
type Ledger struct {
	Mu         sync.Mutex
	Done       map[Ref]bool
	Active     map[string]bool
	Reorders   []string
	Duplicates int
	NowActive  int
	MaxActive  int
	Started    map[Ref]int
}

// NewLedger returns an empty Ledger.
func NewLedger() *Ledger {
	return &Ledger{Done: map[Ref]bool{}, Active: map[string]bool{}, Started: map[Ref]int{}}
}

// Start records that a handler began r.
func (l *Ledger) Start(r Ref) {
	l.Mu.Lock()
	defer l.Mu.Unlock()
	if l.Active[r.Key] {
		l.Reorders = append(l.Reorders, fmt.Sprintf("%s started while another message of its key runs", r))
	}
	if r.Seq > 0 && !l.Done[Ref{r.Key, r.Seq - 1}] {
		l.Reorders = append(l.Reorders, fmt.Sprintf("%s started before %s:%d finished", r, r.Key, r.Seq-1))
	}
	if l.Done[r] {
		l.Duplicates++
	}
	l.Started[r]++
	l.Active[r.Key] = true
	l.NowActive++
	l.MaxActive = max(l.MaxActive, l.NowActive)
}

// End ends a run; finished says whether it succeeded (a nack does not).
func (l *Ledger) End(r Ref, finished bool) {
	l.Mu.Lock()
	defer l.Mu.Unlock()
	l.Active[r.Key] = false
	l.NowActive--
	if finished {
		l.Done[r] = true
	}
}

// Finish ends a run that succeeded.
func (l *Ledger) Finish(r Ref) { l.End(r, true) }

// Count is how many messages are done.
func (l *Ledger) Count() int {
	l.Mu.Lock()
	defer l.Mu.Unlock()
	return len(l.Done)
}

// WaitCount waits until n messages are done, or fails after d.
func (l *Ledger) WaitCount(t *testing.T, n int, d time.Duration) {
	t.Helper()
	require.Eventually(t, func() bool { return l.Count() >= n }, d, 10*time.Millisecond, "messages finished")
}

// StartChild starts this test binary as its TestKeyedChildProcess, with
// spec as JSON in the environment variable env; lines gets each message
// the child finished, and closes when its stdout ends. The child is
// killed at the test's end.
func StartChild(t *testing.T, env string, spec any) (*exec.Cmd, <-chan Ref, *strings.Builder) {
	t.Helper()
	js, err := json.Marshal(spec)
	require.NoError(t, err)
	cmd := exec.Command(os.Args[0], "-test.run=^TestKeyedChildProcess$", "-test.v")
	cmd.Env = append(os.Environ(), env+"="+string(js))
	stderr := &strings.Builder{}
	cmd.Stderr = stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := make(chan Ref, 10000)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if s, ok := strings.CutPrefix(sc.Text(), "done "); ok {
				if r, ok := ParseRef(s); ok {
					lines <- r
				}
			}
		}
	}()
	return cmd, lines, stderr
}

// ChildSpec reads the child's spec from env into spec; false (the test
// is then skipped) in a normal run, where env is unset.
func ChildSpec(t *testing.T, env string, spec any) bool {
	t.Helper()
	js := os.Getenv(env)
	if js == "" {
		return false
	}
	require.NoError(t, json.Unmarshal([]byte(js), spec))
	return true
}

// RunChild subscribes sub to topic and handles its messages as the child
// consumer: each in its own goroutine (as Watermill's Router does), a
// millisecond of simulated work, then "done key:seq" on stdout before its
// ack. A message whose payload is in block never finishes: the process is
// killed with it.
func RunChild(t *testing.T, sub message.Subscriber, topic string, block []string) {
	t.Helper()
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	blocked := map[string]bool{}
	for _, b := range block {
		blocked[b] = true
	}
	var mu sync.Mutex
	out := bufio.NewWriter(os.Stdout)
	for m := range msgs {
		go func(m *message.Message) {
			if blocked[string(m.Payload)] {
				fmt.Fprintf(os.Stderr, "blocking %s\n", m.Payload)
				select {} // never finishes: killed with it
			}
			time.Sleep(time.Millisecond) // the handler's simulated work
			mu.Lock()
			fmt.Fprintf(out, "done %s\n", m.Payload)
			_ = out.Flush()
			mu.Unlock()
			m.Ack()
		}(m)
	}
}

// WaitDone adds the messages the child reports finished (lines, from
// StartChild) to done until it holds want; it fails the test, with the
// child's stderr, if ctx ends or the child's stdout ends first.
func WaitDone(ctx context.Context, t *testing.T, lines <-chan Ref, done map[Ref]bool, want int, stderr *strings.Builder) {
	t.Helper()
	for len(done) < want {
		select {
		case r, ok := <-lines:
			if !ok {
				t.Fatalf("the child ended after finishing %d of %d messages; stderr:\n%s", len(done), want, stderr.String())
			}
			done[r] = true
		case <-ctx.Done():
			t.Fatalf("the child finished %d of %d messages: %v; stderr:\n%s", len(done), want, ctx.Err(), stderr.String())
		}
	}
}

// Kill SIGKILLs the child and adds to done everything it finished before
// it died (its lines until its stdout ends).
func Kill(t *testing.T, cmd *exec.Cmd, lines <-chan Ref, done map[Ref]bool) {
	t.Helper()
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	for r := range lines {
		done[r] = true
	}
	_ = cmd.Wait()
}
