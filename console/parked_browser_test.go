package console_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/poll"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrations"
	"github.com/millwright/millwright/park"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/retry"
)

// TestBrowserParkedKeys drives the parked keys page in chromium against a
// real Router with park on a gochannel broker: a key whose first message
// its handler refuses is dead-lettered and held, its later messages
// parked behind it. The page shows the key with its head and error; the
// dead letter's page says its key is held and links to it; released from
// the key's page (dry run, then confirm), the key's later messages are
// applied in order, each once, counted by the handler.
func TestBrowserParkedKeys(t *testing.T) {
	ctx := browser(t, 120*time.Second)
	s := pgtest.New(t, migrations.All()...)
	db := s.DB
	const topic = "payments.requested"

	var (
		mu      sync.Mutex
		applied []string
		refused int
	)
	handle := func(m *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if string(m.Payload) == "bad" {
			refused++
			return failure.Permanent(fmt.Errorf("payment %s refused: amount missing", m.UUID))
		}
		applied = append(applied, m.UUID)
		return nil
	}
	seen := func() ([]string, int) {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), applied...), refused
	}

	// Publish returns once the consumer acked: the key's messages reach
	// park one at a time, in order.
	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true, BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = broker.Close() })
	parker, err := park.New(postgres.From(db), park.Config{PollInterval: 10 * time.Millisecond,
		Retry: retry.Policy{InitialInterval: 5 * time.Millisecond, MaxInterval: 5 * time.Millisecond, Jitter: retry.JitterNone, MaxAttempts: 5}})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddConsumerHandler("payments", topic, broker, handle).AddMiddleware(parker.Middleware("payments"))
	rctx, stop := context.WithCancel(context.Background())
	routerDone, parkerDone := make(chan error, 1), make(chan error, 1)
	go func() { routerDone <- router.Run(rctx) }()
	<-router.Running()
	go func() { parkerDone <- parker.Run(rctx) }()
	t.Cleanup(func() { stop(); <-routerDone; <-parkerDone })

	publish := func(id, payload string) {
		m := message.NewMessage(id, []byte(payload))
		m.Metadata.Set(metadata.AggregateType, "account")
		m.Metadata.Set(metadata.AggregateID, "acct-7")
		require.NoError(t, broker.Publish(topic, m))
	}
	publish("p1", "bad")
	for _, id := range []string{"p2", "p3", "p4"} {
		publish(id, "ok-"+id)
	}
	store := park.NewStore(postgres.From(db))
	var key park.Key
	poll.Until(t, 30*time.Second, func() bool {
		ks, err := store.List(context.Background(), park.Filter{})
		require.NoError(t, err)
		if len(ks) == 1 && ks[0].Held && ks[0].Messages == 4 {
			key = ks[0]
			return true
		}
		return false
	}, "p1 dead-lettered and its key held, p2..p4 parked behind it")
	got, nrefused := seen()
	require.Empty(t, got, "nothing of the held key applied")
	require.Equal(t, 1, nrefused)
	require.NotZero(t, key.DeadLetterID)

	h, err := console.New(postgres.From(db), console.Config{
		Authenticate: func(http.ResponseWriter, *http.Request) (string, bool) { return browserActor, true },
		Schemas:      []string{s.Name},
		BasePath:     "/ops",
	})
	require.NoError(t, err)
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	base := srv.URL + "/ops"

	do(t, ctx, "the parked keys page",
		chromedp.Navigate(base+"/dead-letters"),
		chromedp.Click(css(`header nav a[href*="/parked"]`)),
		chromedp.WaitVisible(css(`#parked tr.parked-key`)),
		screenshot("parked"),
	)
	require.Equal(t, 1, run(t, ctx, chromedp.Evaluate[int](`document.querySelectorAll("#parked tr.parked-key").length`)))
	require.Equal(t, "account/acct-7", run(t, ctx, chromedp.Text(css(`#parked tr.parked-key a.key-link`))))
	require.Contains(t, run(t, ctx, chromedp.Text(css(`#parked tr.parked-key td.head`))), "p1")
	require.Contains(t, run(t, ctx, chromedp.Text(css(`#parked tr.parked-key td.error-cell`))), "payment p1 refused: amount missing")
	require.Equal(t, "held", run(t, ctx, chromedp.Text(css(`#parked tr.parked-key td.state-held`))))
	require.Equal(t, "3", run(t, ctx, chromedp.Text(css(`#parked tr.parked-key td.waiting`))))

	do(t, ctx, "the filter: retrying keys only",
		chromedp.Navigate(base+"/parked?state=retrying"),
		chromedp.WaitVisible(css(`#no-parked`)),
	)

	do(t, ctx, "the dead letter's page links to its held key",
		chromedp.Navigate(fmt.Sprintf("%s/dead-letters/%d", base, key.DeadLetterID)),
		chromedp.WaitVisible(css(`#parked-state`)),
	)
	state := run(t, ctx, chromedp.Text(css(`#parked-state`)))
	require.Contains(t, state, "held")
	require.Contains(t, state, "3 message(s) wait")
	do(t, ctx, "follow the link to the key",
		chromedp.Click(css(`#parked-key-link`)),
		chromedp.WaitVisible(css(`#release`)),
		screenshot("parked-key"),
	)
	require.Contains(t, run(t, ctx, chromedp.Text(css(`#head`))), "p1")
	require.Contains(t, run(t, ctx, chromedp.Text(css(`#head-error`))), "amount missing")
	require.Equal(t, 4, run(t, ctx, chromedp.Evaluate[int](`document.querySelectorAll("#messages tr.parked-message").length`)))

	do(t, ctx, "release: the dry run",
		chromedp.Click(css(`#release`)),
		chromedp.WaitVisible(css(`#confirm`)),
	)
	require.Contains(t, run(t, ctx, chromedp.Text(css(`#what`))), "drop the head")
	ks, err := store.List(context.Background(), park.Filter{})
	require.NoError(t, err)
	require.True(t, len(ks) == 1 && ks[0].Held && ks[0].Messages == 4, "the dry run changed nothing: %+v", ks)

	do(t, ctx, "release: confirmed",
		chromedp.Click(css(`#confirm`)),
		chromedp.WaitVisible(css(`#done`)),
	)
	poll.Until(t, 30*time.Second, func() bool {
		ks, err := store.List(context.Background(), park.Filter{})
		require.NoError(t, err)
		got, _ := seen()
		return len(ks) == 0 && len(got) >= 3
	}, "the key's later messages applied and the key released")
	got, nrefused = seen()
	require.Equal(t, []string{"p2", "p3", "p4"}, got, "applied in the key's order, each once")
	require.Equal(t, 1, nrefused, "the released head was not run again")
	require.Equal(t, []string{"dead"}, pgtest.Column[string](t, db, `SELECT state FROM millwright_dead_letters WHERE id = $1`, key.DeadLetterID),
		"the released head stays in the DLQ")
	args := pgtest.Column[string](t, db, `SELECT array_to_string(args, ' ') FROM millwright_audit WHERE command = 'console parked release' AND os_user = $1`, browserActor)
	require.Len(t, args, 1, "the release is audited with its operator")
	require.True(t, strings.Contains(args[0], "--handler=payments") && strings.Contains(args[0], "account/acct-7"), args[0])
}
