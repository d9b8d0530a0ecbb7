package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrations"
)

// startConsole runs `millwright console args...` until the test ends and
// returns its address and its output so far.
func startConsole(t *testing.T, args ...string) (string, *syncBuffer) {
	t.Helper()
	root := &cobra.Command{Use: "millwright", SilenceUsage: true, SilenceErrors: true}
	addSchemaFlag(root)
	addDriverFlag(root)
	root.AddCommand(consoleCmd())
	out := &syncBuffer{}
	root.SetOut(out)
	root.SetErr(out)
	root.SetArgs(append([]string{"console", "--listen", "127.0.0.1:0"}, args...))
	ready := make(chan string, 1)
	consoleReady = ready
	t.Cleanup(func() { consoleReady = nil })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("millwright console did not stop within 30s of its context")
		}
	})
	select {
	case addr := <-ready:
		return addr, out
	case err := <-done:
		t.Fatalf("millwright console ended: %v\n%s", err, out.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("millwright console did not listen within 30s:\n%s", out.String())
	}
	return "", nil
}

func consoleGet(t *testing.T, url string, h map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	for k, v := range h {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := (&http.Client{Timeout: 20 * time.Second}).Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String()
}

func TestConsoleCommandWithATokenShowsNoSecret(t *testing.T) { // not parallel: consoleReady
	s := pgtest.New(t, migrations.All()...)
	addr, out := startConsole(t, "--database-url", withPassword(t, pgtest.BaseURL(), "postgres"), "--schema", s.Name, "--token", "t0ken")
	base := "http://" + addr

	status, _ := consoleGet(t, base+"/dead-letters", nil)
	require.Equal(t, http.StatusUnauthorized, status)
	status, _ = consoleGet(t, base+"/dead-letters", map[string]string{"Authorization": "Bearer wrong"})
	require.Equal(t, http.StatusUnauthorized, status)
	for _, path := range []string{"/dead-letters", "/sagas", "/outbox", "/audit"} {
		status, body := consoleGet(t, base+path, map[string]string{"Authorization": "Bearer t0ken"})
		require.Equal(t, http.StatusOK, status, path)
		require.Contains(t, body, `<option selected>`+s.Name+`</option>`, "the schema of --schema is the default")
		require.NotContains(t, body, thePassword, path)
		require.NotContains(t, body, "postgres://", path)
	}
	req, _ := http.NewRequest(http.MethodGet, base+"/audit", nil)
	req.SetBasicAuth("dana", "t0ken")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "basic auth with the token as the password")
	require.Contains(t, out.String(), "authentication: token")
	require.NotContains(t, out.String(), thePassword)
}

func TestConsoleCommandWithoutAuthServesLoopbackHostsOnly(t *testing.T) { // not parallel: consoleReady
	s := pgtest.New(t, migrations.All()...)
	addr, _ := startConsole(t, "--database-url", pgtest.BaseURL(), "--schema", s.Name)
	status, _ := consoleGet(t, "http://"+addr+"/dead-letters", nil)
	require.Equal(t, http.StatusOK, status)
	status, body := consoleGet(t, "http://"+addr+"/dead-letters", map[string]string{"Host": "rebound.example:8089"})
	require.Equal(t, http.StatusMisdirectedRequest, status, "a DNS-rebound name")
	require.Contains(t, body, "only loopback hosts")
}

func TestConsoleAuthChoices(t *testing.T) {
	t.Parallel()
	_, _, err := consoleAuth("0.0.0.0:8089", "", "")
	require.ErrorContains(t, err, "not a loopback address")
	require.ErrorContains(t, err, "--token")
	_, _, err = consoleAuth(":8089", "", "")
	require.ErrorContains(t, err, "not a loopback address", "every interface")
	_, _, err = consoleAuth("127.0.0.1:1", "t", "f")
	require.ErrorContains(t, err, "pass one of them")
	for _, ok := range []string{"127.0.0.1:8089", "[::1]:8089", "localhost:8089"} {
		_, how, err := consoleAuth(ok, "", "")
		require.NoError(t, err, ok)
		require.Contains(t, how, "loopback only")
	}
	_, how, err := consoleAuth("0.0.0.0:8089", "t", "")
	require.NoError(t, err)
	require.Equal(t, "token", how)
}

func TestBasicAuthFile(t *testing.T) {
	t.Parallel()
	hash, err := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost)
	require.NoError(t, err)
	users, err := parseBasicAuth(strings.NewReader("# operators\n\nerin:"+string(hash)+"\n"), "f")
	require.NoError(t, err)
	auth := basicAuthOf(users)
	for _, c := range []struct {
		user, pass string
		ok         bool
	}{{"erin", "pw", true}, {"erin", "nope", false}, {"mallory", "pw", false}} {
		req, _ := http.NewRequest(http.MethodGet, "/", nil)
		req.SetBasicAuth(c.user, c.pass)
		rec := &headerRecorder{h: http.Header{}}
		actor, ok := auth(rec, req)
		require.Equal(t, c.ok, ok, c)
		if ok {
			require.Equal(t, console.Identity{Name: c.user, Role: console.RoleAdmin}, actor)
		} else {
			require.Equal(t, http.StatusUnauthorized, rec.code)
			require.Contains(t, rec.h.Get("WWW-Authenticate"), "Basic")
		}
	}
	_, err = parseBasicAuth(strings.NewReader("erin:plaintext\n"), "f")
	require.ErrorContains(t, err, "not a bcrypt hash")
	_, err = parseBasicAuth(strings.NewReader("no colon\n"), "f")
	require.ErrorContains(t, err, "line 1")
	_, err = parseBasicAuth(strings.NewReader("# nobody\n"), "f")
	require.ErrorContains(t, err, "has no user")
}

type headerRecorder struct {
	h    http.Header
	code int
}

func (r *headerRecorder) Header() http.Header         { return r.h }
func (r *headerRecorder) Write(b []byte) (int, error) { return len(b), nil }
func (r *headerRecorder) WriteHeader(code int)        { r.code = code }

// TestConsoleOnTheDemosData is the README's walkthrough: after the orders
// demo, the console finds the poison message in its group, edits its
// payload and metadata and replays it; billing, run afterwards, charges it
// exactly once.
func TestConsoleOnTheDemosData(t *testing.T) { // not parallel: consoleReady
	if testing.Short() {
		t.Skip("builds and runs the orders demo")
	}
	schema := pgtest.New(t) // the demo migrates it
	bin := filepath.Join(t.TempDir(), "orders")
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "../../examples/orders").CombinedOutput()
	require.NoError(t, err, "building the demo: %s", out)
	demoArgs := []string{"-database-url", pgtest.BaseURL(), "-schema", schema.Name, "-transport", "gochannel"}
	out, err = exec.CommandContext(ctx, bin, append([]string{"demo", "-orders", "4"}, demoArgs...)...).CombinedOutput()
	require.NoError(t, err, "the demo: %s", out)
	require.Contains(t, string(out), "dlq=1")

	addr, _ := startConsole(t, "--database-url", pgtest.BaseURL(), "--schema", schema.Name)
	base := "http://" + addr
	jar, _ := cookiejar.New(nil)
	client := &http.Client{Jar: jar, Timeout: 20 * time.Second}
	page := func(path string) string {
		resp, err := client.Get(base + path)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", path, b)
		return string(b)
	}
	body := page("/dead-letters")
	require.Contains(t, body, "billing.commands")
	require.Contains(t, body, "*json.SyntaxError")
	ids := pgtest.Column[string](t, schema.DB, `SELECT id::text || ' ' || message_uuid FROM millwright_dead_letters`)
	require.Len(t, ids, 1)
	id, uuid, _ := strings.Cut(ids[0], " ")
	body = page("/dead-letters/" + id + "/edit")
	require.Contains(t, body, "{not json")
	tok := regexp.MustCompile(`<meta name="millwright-csrf" content="([^"]+)">`).FindStringSubmatch(body)[1]
	payload := `{"order_id":"` + uuid + `","amount_cents":1250}`
	resp, err := client.PostForm(base+"/dead-letters/"+id+"/edit", url.Values{"csrf": {tok}, "encoding": {"text"}, "payload": {payload},
		"metadata": {`{"ce_id":"` + uuid + `","saga_id":"` + uuid + `","saga_phase":"forward","saga_reply_to":"order_fulfilment.replies"}`},
		"action":   {"replay"}})
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
	require.Contains(t, string(b), "superseded")

	// Billing and a relay, on one in-process broker, deliver it.
	serve := exec.CommandContext(ctx, bin, append([]string{"serve"}, append(demoArgs, "relay", "billing")...)...)
	serve.Cancel = func() error { return serve.Process.Signal(os.Interrupt) }
	serve.WaitDelay = 10 * time.Second
	var serveOut syncBuffer
	serve.Stdout, serve.Stderr = &serveOut, &serveOut
	require.NoError(t, serve.Start())
	defer func() { _ = serve.Process.Signal(os.Interrupt); _ = serve.Wait() }()
	charged := func() []string {
		return pgtest.Column[string](t, schema.DB, `SELECT status || ' ' || amount_cents FROM orders_payments WHERE order_id = $1`, uuid)
	}
	poll.Until(t, time.Minute, func() bool { return len(charged()) > 0 }, "billing charges the edited command:\n%s", &serveOut)
	require.Equal(t, []string{"charged 1250"}, charged())
	require.Equal(t, []string{"1"}, pgtest.Column[string](t, schema.DB, `SELECT count(*)::text FROM millwright_processed_events WHERE event_id = $1`, uuid))
}
