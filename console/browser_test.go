package console_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/outbox/relay"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
	"github.com/millwright/millwright/saga"
	"github.com/millwright/millwright/saga/sagatest"
	"github.com/millwright/millwright/transport/lag"
)

// Environment of the browser test: the chromium binary (scripts/chromium.sh
// prints it), CI's demand that the test runs, and where to write the
// README's screenshots (unset: none are written).
const (
	envChromium        = "MILLWRIGHT_TEST_CHROMIUM"
	envRequireChromium = "MILLWRIGHT_TEST_REQUIRE_CHROMIUM"
	envScreenshots     = "MILLWRIGHT_CONSOLE_SCREENSHOTS"
)

const browserActor = "ops-alice"

// shop is the real pipeline the browser test drives: an outbox relay
// publishing to gochannel, a consumer behind the dlq middleware that
// records what it processed in Postgres, the dead-letter recorder, and a
// saga that compensates.
type shop struct {
	schema *pgtest.Schema
	topic  string
	// diagram is the saga definition's Mermaid.
	diagram string
}

// runShop starts the pipeline; it stops at test cleanup.
func runShop(t *testing.T) *shop {
	t.Helper()
	s := pgtest.New(t, migrations.All()...)
	_, err := s.DB.Exec(`CREATE TABLE processed (event_id TEXT NOT NULL, payload TEXT NOT NULL)`)
	require.NoError(t, err)
	sh := &shop{schema: s, topic: "orders.placed"}
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	mw, err := dlq.NewMiddleware(broker, dlq.Config{ConsumerGroup: "billing", Retry: retry.Policy{MaxAttempts: 1}})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("billing", sh.topic, broker, noPublish(mw.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		var order struct {
			Qty int `json:"qty"`
		}
		if err := json.Unmarshal(msg.Payload, &order); err != nil {
			return nil, failure.Permanent(fmt.Errorf("billing: decoding order: %w", err))
		}
		_, err := s.DB.ExecContext(msg.Context(), `INSERT INTO processed VALUES ($1, $2)`, msg.UUID, string(msg.Payload))
		return nil, err
	})))
	router.AddConsumerHandler("dlq-recorder", dlq.DefaultTopic(sh.topic), broker, dlq.NewStore(postgres.From(s.DB)).Record)

	cmd := func(struct{}) (saga.Command, error) {
		return saga.Command{Topic: "transfer.commands", Payload: struct{}{}}, nil
	}
	def := saga.MustDefine("transfer",
		saga.Step[struct{}]{Name: "debit", Command: cmd, Compensation: cmd},
		saga.Step[struct{}]{Name: "credit", Command: cmd, Compensation: cmd},
	)
	sh.diagram = def.Mermaid()
	o, err := saga.NewOrchestrator(postgres.From(s.DB), def, saga.Config{})
	require.NoError(t, err)
	p := sagatest.NewParticipant(broker)
	p.Script(func(c sagatest.Command) sagatest.Answer {
		if c.Step == "credit" {
			return sagatest.Fail
		}
		return sagatest.Succeed
	})
	router.AddConsumerHandler("participant", "transfer.commands", broker, p.Handle)
	router.AddConsumerHandler("orchestrator", o.ReplyTopic(), broker, o.HandleReply)

	ctx, cancel := context.WithCancel(context.Background())
	// What Orchestrator.Run does first: record the definition's step
	// graph, which the console draws the saga page's diagram from.
	require.NoError(t, o.CheckVersions(ctx))
	routerDone := make(chan error, 1)
	go func() { routerDone <- router.Run(ctx) }()
	<-router.Running()
	rel, err := relay.New(postgres.From(s.DB), broker, relay.Config{PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	relayDone := make(chan error, 1)
	go func() { relayDone <- rel.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		_ = rel.Close()
		_ = router.Close()
		<-relayDone
		<-routerDone
	})

	require.NoError(t, o.StartOutsideTx(ctx, postgres.From(s.DB), "transfer-1", struct{}{}))
	wait, stop := context.WithTimeout(ctx, 30*time.Second)
	defer stop()
	info, err := sagatest.WaitState(wait, postgres.From(s.DB), "transfer-1", saga.StateCompleted, saga.StateCompensated)
	require.NoError(t, err)
	require.Equal(t, saga.StateCompensated, info.State)
	return sh
}

func noPublish(h message.HandlerFunc) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		_, err := h(msg)
		return err
	}
}

// place writes an order event to the outbox; the relay publishes it.
func (sh *shop) place(t *testing.T, id, payload string) {
	t.Helper()
	require.NoError(t, outbox.AddOutsideTx(context.Background(), postgres.From(sh.schema.DB), outbox.Event{
		Topic: sh.topic, ID: id, AggregateType: "order", AggregateID: id, Payload: []byte(payload), RawPayload: true,
	}))
}

// deadLetterID waits until the message of event id is dead-lettered.
func (sh *shop) deadLetterID(t *testing.T, id string) int64 {
	t.Helper()
	var out int64
	poll.Until(t, 30*time.Second, func() bool {
		ids := pgtest.Column[int64](t, sh.schema.DB, `SELECT id FROM millwright_dead_letters WHERE message_uuid = $1`, id)
		if len(ids) == 1 {
			out = ids[0]
		}
		return len(ids) == 1
	}, "message %s dead-lettered", id)
	return out
}

func chromium(t *testing.T) string {
	t.Helper()
	path := os.Getenv(envChromium)
	if path == "" {
		if os.Getenv(envRequireChromium) != "" {
			t.Fatalf("%s is set but %s is not: run `eval \"$(bash scripts/chromium.sh)\"`", envRequireChromium, envChromium)
		}
		t.Skipf("%s is not set: run `eval \"$(bash scripts/chromium.sh)\"` to run the browser test", envChromium)
	}
	return path
}

// browser starts a headless chromium for the test, bounded by timeout.
func browser(t *testing.T, timeout time.Duration) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium(t)), chromedp.NoSandbox, chromedp.DisableGPU, chromedp.WindowSize(1280, 900))
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(actx)
	ctx, cancelTimeout := context.WithTimeout(ctx, timeout)
	t.Cleanup(func() {
		cancelTimeout()
		cancelCtx()
		cancelAlloc()
	})
	require.NoError(t, chromedp.Do(ctx), "starting chromium")
	return ctx
}

// screenshot writes the page to $MILLWRIGHT_CONSOLE_SCREENSHOTS/name.png
// when that is set; a relative directory is relative to the module root
// (MILLWRIGHT_CONSOLE_SCREENSHOTS=docs/console writes the README's).
func screenshot(name string) chromedp.Action[chromedp.Void] {
	dir := os.Getenv(envScreenshots)
	if dir != "" && !filepath.IsAbs(dir) {
		dir = filepath.Join("..", dir)
	}
	return chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
		if dir == "" {
			return nil
		}
		png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644)
	})
}

// css is a CSS selector (a plain string is a DOM search).
type css = chromedp.CSS

// do runs the actions of one step within 30s (the test's whole bound
// still applies), failing the test with the step's name and the page's
// address and text when they do not finish.
func do(t *testing.T, ctx context.Context, name string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(sctx, actions...); err != nil {
		loc, _ := chromedp.Run(ctx, chromedp.Location())
		text, _ := chromedp.Run(ctx, chromedp.Text(css("body")))
		t.Fatalf("browser step %q: %v\nat %s:\n%s", name, err, loc, text)
	}
}

// run runs an action and returns its value, failing the test on error.
func run[T any](t *testing.T, ctx context.Context, a chromedp.Action[T]) T {
	t.Helper()
	v, err := chromedp.Run(ctx, a)
	require.NoError(t, err)
	return v
}

// TestBrowser drives the console in chromium through a poison message's
// life: dead-lettered by a real handler, found in its group, edited,
// replayed; the consumer processes the edited message exactly once and
// the original never. On the way: a payload with a script does not run, a
// POST without the CSRF token is refused, a compensated saga's timeline
// shows its steps in order.
func TestBrowser(t *testing.T) {
	ctx := browser(t, 100*time.Second)
	sh := runShop(t)
	h, err := console.New(postgres.From(sh.schema.DB), console.Config{
		Authenticate: func(http.ResponseWriter, *http.Request) (string, bool) { return browserActor, true },
		Schemas:      []string{sh.schema.Name},
		SagaDiagrams: map[string]string{"transfer": sh.diagram},
		BasePath:     "/ops",
		Lag:          browserLag,
	})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	base := srv.URL + "/ops"

	sh.place(t, "order-ok", `{"qty":1}`)
	sh.place(t, "order-poison", `{"qty":"two"}`)
	sh.place(t, "order-xss", `<script>document.title="pwned";window.pwned=1</script>`)
	poison := sh.deadLetterID(t, "order-poison")
	xss := sh.deadLetterID(t, "order-xss")

	// The poison message's group, then the message itself.
	do(t, ctx, "find the poison message in its group",
		chromedp.Navigate(base+"/dead-letters"),
		chromedp.WaitVisible(css(`#groups`)),
		screenshot("dead-letters"),
		chromedp.Click(css(`#groups a.group-link[href*="UnmarshalTypeError"]`)),
		chromedp.WaitVisible(css(`#filter-active`)),
		chromedp.WaitVisible(css(fmt.Sprintf(`#letters tr[data-id="%d"]`, poison))),
		chromedp.Click(css(fmt.Sprintf(`#letters tr[data-id="%d"] a.letter-link`, poison))),
		chromedp.WaitVisible(css(`#edit`)),
	)
	require.Equal(t, fmt.Sprintf("Dead letter %d · millwright console", poison), run(t, ctx, chromedp.Title()))

	checkScriptDoesNotRun(t, ctx, base, xss)
	checkPostWithoutTokenRefused(t, ctx, sh, base, xss)
	editAndReplay(t, ctx, sh, base, poison)
	checkSagaTimeline(t, ctx, sh, base)
	checkAudit(t, ctx, sh, base)
	checkLag(t, ctx, base)
}

// checkScriptDoesNotRun: a payload with a script is shown as text and
// does not run.
func checkScriptDoesNotRun(t *testing.T, ctx context.Context, base string, xss int64) {
	do(t, ctx, "open the dead letter with a script",
		chromedp.Navigate(fmt.Sprintf("%s/dead-letters/%d", base, xss)),
		chromedp.WaitVisible(css(`pre.payload-text`)),
		screenshot("dead-letter"),
	)
	require.Contains(t, run(t, ctx, chromedp.Text(css(`pre.payload-text`))), `<script>document.title="pwned"`)
	require.False(t, run(t, ctx, chromedp.Evaluate[bool](`window.pwned === 1`)), "the payload's script ran")
	require.Equal(t, fmt.Sprintf("Dead letter %d · millwright console", xss), run(t, ctx, chromedp.Title()), "the payload's script ran")

}

// checkPostWithoutTokenRefused: a POST without the token is refused, and
// changes nothing.
func checkPostWithoutTokenRefused(t *testing.T, ctx context.Context, sh *shop, base string, xss int64) {
	// A POST without the token is refused, and changes nothing: a form the
	// page did not render (the CSP blocks fetch), submitted from the page.
	do(t, ctx, "post a replay without the CSRF token",
		chromedp.Evaluate[chromedp.Void](fmt.Sprintf(`(() => { const f = document.createElement("form");
			f.method = "post"; f.action = %q;
			for (const [k, v] of [["id", "%d"], ["action", "replay"], ["schema", %q]]) {
				const i = document.createElement("input"); i.type = "hidden"; i.name = k; i.value = v; f.appendChild(i) }
			document.body.appendChild(f); f.submit() })()`, base+"/dead-letters/replay", xss, sh.schema.Name)),
		chromedp.WaitVisible(css(`#error`)),
	)
	require.Equal(t, "403 Forbidden", run(t, ctx, chromedp.Text(css(`h1`))))
	require.Contains(t, run(t, ctx, chromedp.Text(css(`#error`))), "CSRF token")
	require.Equal(t, []string{"dead"}, pgtest.Column[string](t, sh.schema.DB, `SELECT state FROM millwright_dead_letters WHERE id = $1`, xss))

}

// editAndReplay edits the poison message, previews the diff and replays
// it; the consumer processes the edited message once and the original
// never.
func editAndReplay(t *testing.T, ctx context.Context, sh *shop, base string, poison int64) {
	do(t, ctx, "edit and preview",
		chromedp.Navigate(fmt.Sprintf("%s/dead-letters/%d/edit", base, poison)),
		chromedp.WaitVisible(css(`#payload`)),
		chromedp.SetValue(css(`#payload`), `{"qty": 2}`),
		chromedp.Click(css(`#preview`)),
		chromedp.WaitVisible(css(`#diff`)),
		screenshot("edit-preview"),
	)
	diff := run(t, ctx, chromedp.Text(css(`#diff`)))
	require.Contains(t, diff, `-   "qty": "two"`)
	require.Contains(t, diff, `+   "qty": 2`)
	do(t, ctx, "replay the edited message", chromedp.Click(css(`#confirm`)), chromedp.WaitVisible(css(`#done`)))
	require.Contains(t, run(t, ctx, chromedp.Text(css(`#done`))), "superseded")

	// The consumer processed the edited message once, and the original
	// never: the outbox has drained, and only the edited payload arrived.
	processed := func() []string {
		return pgtest.Column[string](t, sh.schema.DB, `SELECT payload FROM processed WHERE event_id = 'order-poison'`)
	}
	poll.Until(t, 30*time.Second, func() bool {
		return len(processed()) > 0 &&
			len(pgtest.Column[int64](t, sh.schema.DB, `SELECT id FROM millwright_outbox WHERE status <> 'published'`)) == 0
	}, "the edited message processed and the outbox drained")
	require.Equal(t, []string{`{"qty": 2}`}, processed())
	require.Equal(t, []string{`{"qty":1}`}, pgtest.Column[string](t, sh.schema.DB, `SELECT payload FROM processed WHERE event_id = 'order-ok'`))
	require.Equal(t, []string{"superseded"}, pgtest.Column[string](t, sh.schema.DB, `SELECT state FROM millwright_dead_letters WHERE id = $1`, poison))
	require.Equal(t, []int64{1}, pgtest.Column[int64](t, sh.schema.DB, `SELECT count(*) FROM millwright_dead_letters WHERE message_uuid = 'order-poison'`),
		"the edited message was not dead-lettered again")

}

// checkSagaTimeline: the compensated saga's timeline, in order, and its
// definition's diagram.
func checkSagaTimeline(t *testing.T, ctx context.Context, sh *shop, base string) {
	do(t, ctx, "open the compensated saga",
		chromedp.Navigate(base+"/sagas?state=compensated"),
		chromedp.WaitVisible(css(`#sagas a.saga-link`)),
		screenshot("sagas"),
		chromedp.Click(css(`#sagas a.saga-link`)),
		chromedp.WaitVisible(css(`#timeline`)),
		screenshot("saga"),
	)
	kinds := run(t, ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#timeline li .kind")].map(e => e.textContent)`))
	steps := run(t, ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#timeline li .step")].map(e => e.textContent)`))
	var got []string
	for i := range kinds {
		got = append(got, kinds[i]+" "+steps[i])
	}
	require.Equal(t, []string{"command debit", "reply debit", "command credit", "reply credit",
		"compensation debit", "compensation_reply debit", "compensated "}, got, "the timeline, in the order of the saga's history")
	require.Equal(t, sh.diagram, run(t, ctx, chromedp.Text(css(`#diagram`))))
	checkSagaDiagram(t, ctx)

}

// checkAudit: the outbox and the audit pages; the edit is recorded with
// its operator.
func checkAudit(t *testing.T, ctx context.Context, sh *shop, base string) {
	// A row the relay gave up on, for the outbox page to show.
	_, err := sh.schema.DB.Exec(`INSERT INTO millwright_outbox (event_id, topic, aggregate_id, payload, status, retry_count, last_error)
		VALUES ('invoice-7', 'invoices.issued', 'invoice-7', '{}', 'failed', 10, 'publishing to invoices.issued: kafka server: Message was too large')`)
	require.NoError(t, err)
	do(t, ctx, "the outbox and audit pages",
		chromedp.Navigate(base+"/outbox"),
		chromedp.WaitVisible(css(`#retry-selected`)),
		screenshot("outbox"),
		chromedp.Navigate(base+"/audit"),
		chromedp.WaitVisible(css(`#audit td.who`)),
		screenshot("audit"),
	)
	require.Equal(t, browserActor, run(t, ctx, chromedp.Text(css(`#audit td.who`))))
	require.Equal(t, dlq.EditReplayCommand, run(t, ctx, chromedp.Text(css(`#audit td.command`))))
}

// checkSagaDiagram: the compensated saga's definition is drawn as an SVG
// from the step graph its orchestrator recorded, with the path it took:
// debit taken, credit failed, debit's compensation sent and done,
// credit's compensation never sent, and the saga at Compensated. Its
// timeline is drawn to scale: one bar per command and its reply.
func checkSagaDiagram(t *testing.T, ctx context.Context) {
	classes := run(t, ctx, chromedp.Evaluate[map[string]string](`Object.fromEntries([...document.querySelectorAll("#saga-diagram g.dg-box")].map(
		g => [(g.classList.contains("undo") ? "undo " : "") + (g.dataset.step || g.textContent), g.getAttribute("class")]))`))
	require.Equal(t, map[string]string{
		"debit":       "dg-box step kind-command taken",
		"credit":      "dg-box step kind-command failed",
		"undo debit":  "dg-box undo comp-done",
		"undo credit": "dg-box undo",
		"Completed":   "dg-box end end-completed",
		"Compensated": "dg-box end end-compensated taken current",
	}, classes, "the diagram's boxes and what this saga did at each")
	edges := run(t, ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#saga-diagram line.dg-edge.taken")].map(l => l.getAttribute("class"))`))
	require.Equal(t, []string{"dg-edge fwd taken", "dg-edge comp undo-link taken", "dg-edge comp taken", "dg-edge fail taken"}, edges,
		"the edges this saga took: debit to credit, debit's compensation, from it to Compensated, and credit's failure to it")
	bars := run(t, ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#saga-gantt g.gt-bar")].map(g => g.getAttribute("class"))`))
	require.Equal(t, []string{"gt-bar gt-forward", "gt-bar gt-failed", "gt-bar gt-compensation"}, bars, "the timeline's bars: debit, credit (failed), debit's compensation")
	took := run(t, ctx, chromedp.Evaluate[int](`document.querySelectorAll("#timeline li .took").length`))
	require.Equal(t, 3, took, "each reply on the timeline says how long its command took")
}

// browserLag is the Lag page's reader in the browser test: fixed rows (the
// figures from the real brokers are TestLagOfAConsumerGroupOnKafka's and
// transport/kafka's TestLagOfAKeyParallelConsumer's).
var browserLag = lag.Readers{fixedLag{
	{Transport: "kafka", Group: "billing", Topic: "orders.placed", Partition: 0, Committed: 4100, End: 5100, Lag: 1000, Unacked: -1, Keyed: true, KeysInFlight: 12, Waiting: 31},
	{Transport: "kafka", Group: "billing", Topic: "orders.placed", Partition: 1, Committed: 5012, End: 5012, Lag: 0, Unacked: -1, Keyed: true, KeysInFlight: 0, Waiting: 0},
	{Transport: "amqp", Group: "shipping", Topic: "orders.placed_shipping", Partition: lag.NoPartition, Committed: -1, End: -1, Lag: 42, Unacked: 8},
}}

type fixedLag []lag.Partition

func (f fixedLag) Lag(context.Context) ([]lag.Partition, error) { return f, nil }

// checkLag: the Lag page shows each group's total and its partitions.
func checkLag(t *testing.T, ctx context.Context, base string) {
	do(t, ctx, "the lag page",
		chromedp.Navigate(base+"/lag"),
		chromedp.WaitVisible(css(`table.lag`)),
		screenshot("lag"),
	)
	totals := run(t, ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("h2.lag-group")].map(h => h.textContent)`))
	require.Equal(t, []string{"amqp · shipping · 42 behind", "kafka · billing · 1000 behind"}, totals)
	require.Equal(t, "1000", run(t, ctx, chromedp.Text(css(`table.lag[data-group="billing"] tr[data-partition="0"] td.lag-messages`))))
}
