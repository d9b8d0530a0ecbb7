package shutdown_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/shutdown"
)

// childEnv, when set, makes the test binary run serviceMain instead of
// the tests: a service process the tests signal.
const childEnv = "MILLWRIGHT_SHUTDOWN_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(serviceMain())
	}
	os.Exit(m.Run())
}

// serviceMain is a service's main: a Watermill router (CloseTimeout 10 s,
// as the examples') whose handler takes CHILD_HANDLER and then writes its
// effect (the message's payload) to CHILD_EFFECT, under shutdown.Service
// with the grace $MILLWRIGHT_SHUTDOWN_GRACE (default 25 s). It prints "in
// flight" once the handler runs.
func serviceMain() int {
	hold, err := time.ParseDuration(os.Getenv("CHILD_HANDLER"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "CHILD_HANDLER:", err)
		return 2
	}
	ctx, stop, err := shutdown.Service(context.Background(), shutdown.Config{Name: "svc"})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer stop()
	pubsub := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	router.AddMiddleware(shutdown.Middleware)
	router.AddConsumerHandler("slow_handler", "jobs", pubsub, func(msg *message.Message) error {
		fmt.Println("in flight")
		time.Sleep(hold) // work that does not watch the signal
		return os.WriteFile(os.Getenv("CHILD_EFFECT"), msg.Payload, 0o600)
	})
	go func() {
		<-router.Running()
		_ = pubsub.Publish("jobs", message.NewMessage("job-1", []byte("applied")))
	}()
	if err := router.Run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "router:", err)
		return 1
	}
	fmt.Fprintln(os.Stderr, "svc: stopped cleanly")
	return 0
}

// startService runs serviceMain in a process of its own with the given
// grace (empty: the default) and handler duration, waits until its
// handler is in flight, and sends it SIGTERM.
func startService(t *testing.T, grace string, handler time.Duration) (effect string, cmd *exec.Cmd, stderr *strings.Builder) {
	t.Helper()
	effect = filepath.Join(t.TempDir(), "effect")
	cmd = exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_HANDLER="+handler.String(), "CHILD_EFFECT="+effect)
	if grace != "" {
		cmd.Env = append(cmd.Env, shutdown.GraceEnv+"="+grace)
	}
	stderr = &strings.Builder{}
	cmd.Stderr = stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
	}()
	select {
	case l := <-lines:
		require.Equal(t, "in flight", l)
	case <-time.After(time.Minute):
		t.Fatalf("the service's handler did not start within a minute; stderr: %s", stderr)
	}
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	return effect, cmd, stderr
}

// wait waits for the service to exit (a hang fails the test) and returns
// its exit code.
func wait(t *testing.T, cmd *exec.Cmd, stderr *strings.Builder) int {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return ee.ExitCode()
		}
		require.NoError(t, err, "stderr: %s", stderr)
		return 0
	case <-time.After(2 * time.Minute):
		t.Fatalf("the service did not exit within 2 minutes of SIGTERM; stderr: %s", stderr)
		return -1
	}
}

// SIGTERM with a 3 s handler in flight: the service (default grace, 25 s)
// lets it finish, its effect is applied, and it exits 0. Before, a
// service had Context's 750 ms: it exited 1 with the handler cut off.
func TestServiceLetsAHandlerInFlightFinishAndExitsZero(t *testing.T) {
	t.Parallel()
	effect, cmd, stderr := startService(t, "", 3*time.Second)
	require.Equal(t, 0, wait(t, cmd, stderr), "stderr: %s", stderr)
	got, err := os.ReadFile(effect)
	require.NoError(t, err, "the handler's effect was applied; stderr: %s", stderr)
	require.Equal(t, "applied", string(got))
	require.Contains(t, stderr.String(), "svc: stopped cleanly")
}

// A handler that outlasts the grace: the service is made to exit, status
// 1, naming the handler it waited for; the effect was not applied.
func TestServicePastItsGraceExitsNamingTheHandler(t *testing.T) {
	t.Parallel()
	effect, cmd, stderr := startService(t, "1s", time.Minute)
	require.Equal(t, 1, wait(t, cmd, stderr), "stderr: %s", stderr)
	msg := stderr.String()
	require.Regexp(t, `svc: terminated signal received; still waiting after 1(\.\d+)?s for handler slow_handler: 1 in flight, the oldest for [\d.]+s`, msg)
	require.Contains(t, msg, "(message job-1)")
	require.NoFileExists(t, effect)
}

// An invalid grace is an error naming the variable, before any signal.
func TestServiceRefusesAnInvalidGrace(t *testing.T) {
	t.Setenv(shutdown.GraceEnv, "25")
	_, _, err := shutdown.Service(context.Background(), shutdown.Config{Name: "svc"})
	require.ErrorContains(t, err, shutdown.GraceEnv+`="25": want a duration such as 25s`)
	_, _, err = shutdown.Service(context.Background(), shutdown.Config{Name: "svc", Grace: -time.Second})
	require.ErrorContains(t, err, "shutdown: Config.Grace -1s: want above 0")
	t.Setenv(shutdown.GraceEnv, "2h")
	_, _, err = shutdown.Service(context.Background(), shutdown.Config{Name: "svc"})
	require.ErrorContains(t, err, "shutdown: "+shutdown.GraceEnv+" 2h0m0s: want above 0 and at most 1h0m0s")
}
