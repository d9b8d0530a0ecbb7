// Package pgconntest provides the unresponsive servers the tests of
// millwright's connection bounds run against: one that accepts TCP and
// never answers, one that completes the Postgres startup and then never
// answers a statement, and an address that refuses connections. Each
// counts what it accepted, so a test can prove its fault happened. Build
// and Start run a command's real binary against them, to send it signals.
package pgconntest

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Server is a loopback TCP server that holds every connection it accepts
// until the test ends.
type Server struct {
	ln        net.Listener
	accepted  atomic.Int64
	firstAt   time.Time // when the first connection was accepted; set before firstConn closes
	firstConn chan struct{}
	firstMsg  chan struct{}
	once      [2]sync.Once
	mu        sync.Mutex
	conns     []net.Conn
}

// Accepting is closed when the server has accepted its first connection:
// from then on the client waits for an answer.
func (s *Server) Accepting() <-chan struct{} { return s.firstConn }

// Waiting is closed when an AfterStartup server has received the first
// bytes after a startup (a statement): from then on the client waits for
// its answer.
func (s *Server) Waiting() <-chan struct{} { return s.firstMsg }

// FirstAccepted is when the server accepted its first connection (the
// zero time if it accepted none yet): the moment the client started
// waiting for an answer, measured on the server's side, so a bound from
// it leaves out the client process's start.
func (s *Server) FirstAccepted() time.Time {
	select {
	case <-s.firstConn:
		return s.firstAt
	default:
		return time.Time{}
	}
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// URL is a postgres URL reaching the server, with query appended (e.g.
// "connect_timeout=1"; "" for none).
func (s *Server) URL(query string) string {
	u := "postgres://u:hunter2@" + s.Addr() + "/db?sslmode=disable"
	if query != "" {
		u += "&" + query
	}
	return u
}

// Accepted is how many connections the server accepted.
func (s *Server) Accepted() int64 { return s.accepted.Load() }

// Silent starts a server that accepts connections and never sends a byte.
func Silent(tb testing.TB) *Server { return start(tb, nil) }

// AfterStartup starts a server that completes the Postgres startup of
// every connection (trust authentication) and then never answers.
func AfterStartup(tb testing.TB) *Server { return start(tb, startup) }

// Refused returns a loopback address nothing listens on.
func Refused(tb testing.TB) string {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("pgconntest: %v", err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func start(tb testing.TB, greet func(*Server, net.Conn)) *Server {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("pgconntest: %v", err)
	}
	s := &Server{ln: ln, firstConn: make(chan struct{}), firstMsg: make(chan struct{})}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.accepted.Add(1)
			s.mu.Lock()
			s.conns = append(s.conns, c)
			s.mu.Unlock()
			s.once[0].Do(func() {
				s.firstAt = time.Now()
				close(s.firstConn)
			})
			if greet != nil {
				go greet(s, c)
			}
		}
	}()
	tb.Cleanup(func() {
		ln.Close()
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, c := range s.conns {
			c.Close()
		}
	})
	return s
}

// startup reads the StartupMessage and answers AuthenticationOk,
// BackendKeyData and ReadyForQuery; then it reads and discards whatever
// the client sends.
func startup(s *Server, c net.Conn) {
	var n [4]byte
	if _, err := io.ReadFull(c, n[:]); err != nil {
		return
	}
	if _, err := io.CopyN(io.Discard, c, int64(binary.BigEndian.Uint32(n[:]))-4); err != nil {
		return
	}
	msg := func(typ byte, body ...byte) []byte {
		b := []byte{typ, 0, 0, 0, 0}
		binary.BigEndian.PutUint32(b[1:], uint32(4+len(body)))
		return append(b, body...)
	}
	var out []byte
	out = append(out, msg('R', 0, 0, 0, 0)...)             // AuthenticationOk
	out = append(out, msg('K', 0, 0, 0, 1, 0, 0, 0, 2)...) // BackendKeyData
	out = append(out, msg('Z', 'I')...)                    // ReadyForQuery, idle
	if _, err := c.Write(out); err != nil {
		return
	}
	var b [1]byte
	if _, err := c.Read(b[:]); err != nil {
		return
	}
	s.once[1].Do(func() { close(s.firstMsg) })
	_, _ = io.Copy(io.Discard, c)
}

// Build compiles the main package in dir (relative to the test's package
// directory, "." for itself) into a temporary directory and returns the
// binary's path.
func Build(tb testing.TB, dir string) string {
	tb.Helper()
	abs, err := filepath.Abs(dir)
	if err != nil {
		tb.Fatalf("pgconntest: %v", err)
	}
	bin := filepath.Join(tb.TempDir(), filepath.Base(abs))
	out, err := exec.Command("go", "build", "-o", bin, dir).CombinedOutput()
	if err != nil {
		tb.Fatalf("pgconntest: go build %s: %v\n%s", dir, err, out)
	}
	return bin
}

// Process is a started binary.
type Process struct {
	cmd    *exec.Cmd
	stderr bytes.Buffer
	done   chan struct{}
	err    error
	ended  time.Time
}

// Start runs bin with args and extra environment variables (KEY=value).
// The process is killed at the end of the test if still running.
func Start(tb testing.TB, bin string, env []string, args ...string) *Process {
	tb.Helper()
	p := &Process{cmd: exec.Command(bin, args...), done: make(chan struct{})}
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stderr = &p.stderr
	p.cmd.Stdout = &p.stderr
	if err := p.cmd.Start(); err != nil {
		tb.Fatalf("pgconntest: starting %s: %v", bin, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		p.ended = time.Now()
		close(p.done)
	}()
	tb.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// Signal sends sig to the process and returns when it was sent.
func (p *Process) Signal(tb testing.TB, sig os.Signal) time.Time {
	tb.Helper()
	at := time.Now()
	if err := p.cmd.Process.Signal(sig); err != nil {
		tb.Fatalf("pgconntest: signal: %v", err)
	}
	return at
}

// Wait waits at most limit for the process to exit and returns when it
// did, its exit code and its output (stdout and stderr); ok is false if it
// was still running after limit (it is then killed).
func (p *Process) Wait(limit time.Duration) (ended time.Time, code int, output string, ok bool) {
	select {
	case <-p.done:
	case <-time.After(limit):
		_ = p.cmd.Process.Kill()
		<-p.done
		return p.ended, -1, p.stderr.String(), false
	}
	return p.ended, p.cmd.ProcessState.ExitCode(), p.stderr.String(), true
}

// AwaitAccepted waits until srv has accepted a connection (from then on
// the process waits for an answer), failing the test if the process ends
// first or limit passes.
func (p *Process) AwaitAccepted(tb testing.TB, srv *Server, limit time.Duration) {
	tb.Helper()
	select {
	case <-srv.Accepting():
	case <-p.done:
		tb.Fatalf("pgconntest: the process ended before connecting to %s:\n%s", srv.Addr(), p.stderr.String())
	case <-time.After(limit):
		tb.Fatalf("pgconntest: no connection to %s within %s", srv.Addr(), limit)
	}
}

// DefaultConnectTimeout is the connect_timeout millwright applies when a
// URL has none (pgconn.DefaultConnectTimeout, not imported here to keep
// this harness free of the code it tests).
const DefaultConnectTimeout = 10 * time.Second

// hangLimit bounds a wait for a process that should end: only a real hang
// reaches it, not a loaded machine.
const hangLimit = 60 * time.Second

// RequireGivesUpOnSilentServer runs bin with the arguments args returns
// for a database URL, against a server that accepts and never answers,
// with connect_timeout=1: the process must exit with code 1, saying the
// server accepted but did not answer within 1s, and before the default
// connect_timeout (10 s) could have ended the attempt, counted from the
// server's accept (so the process's own start, slow on a loaded machine,
// is left out). It returns the output for the caller's own checks.
func RequireGivesUpOnSilentServer(tb testing.TB, bin string, args func(databaseURL string) []string) string {
	tb.Helper()
	srv := Silent(tb)
	p := Start(tb, bin, nil, args(srv.URL("connect_timeout=1"))...)
	ended, code, out, ok := p.Wait(hangLimit)
	switch {
	case !ok:
		tb.Fatalf("still running after %s with connect_timeout=1:\n%s", hangLimit, out)
	case code != 1:
		tb.Fatalf("exit code %d, want 1:\n%s", code, out)
	case srv.Accepted() == 0:
		tb.Fatalf("the fault did not happen: the server accepted no connection:\n%s", out)
	case ended.Sub(srv.FirstAccepted()) >= DefaultConnectTimeout:
		tb.Fatalf("exited %s after the server accepted: the default connect_timeout (%s) ended the attempt, not the URL's 1s:\n%s",
			ended.Sub(srv.FirstAccepted()), DefaultConnectTimeout, out)
	}
	want := "postgres at " + srv.Addr() + " accepted the connection but did not answer within 1s (connect_timeout"
	if !strings.Contains(out, want) {
		tb.Fatalf("output lacks %q:\n%s", want, out)
	}
	return out
}

// RequireStopsOnSignal runs bin with the arguments args returns for a
// database URL against a server that accepts and never answers, with
// connect_timeout=120 (so only the signal can end the attempt within the
// test), sends sig once the server has the connection, and requires the
// process to exit with code 1, saying it was interrupted while connecting
// and by which signal. A process that did not hear the signal would run
// until connect_timeout and fail the 60 s bound. No bound on how soon it
// exits: on a loaded machine that is scheduling, not the product (before,
// "within a second" of the signal, beside 18 sibling processes).
// It returns the output for the caller's own checks.
func RequireStopsOnSignal(tb testing.TB, bin string, sig os.Signal, args func(databaseURL string) []string) string {
	tb.Helper()
	srv := Silent(tb)
	p := Start(tb, bin, nil, args(srv.URL("connect_timeout=120"))...)
	p.AwaitAccepted(tb, srv, hangLimit)
	p.Signal(tb, sig)
	_, code, out, ok := p.Wait(hangLimit)
	switch {
	case !ok:
		tb.Fatalf("still running %s after %s (connect_timeout=120): the signal did not end the attempt:\n%s", hangLimit, sig, out)
	case code != 1:
		tb.Fatalf("exit code %d, want 1:\n%s", code, out)
	}
	for _, want := range []string{
		"interrupted while connecting to postgres at " + srv.Addr() + " (",
		fmt.Sprintf("%v signal received", sig), // signal.NotifyContext's cause
	} {
		if !strings.Contains(out, want) {
			tb.Fatalf("output lacks %q:\n%s", want, out)
		}
	}
	return out
}
