package amqp_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/amqp"
	"github.com/millwright/millwright/transport/lag"
	"github.com/millwright/millwright/transport/transporttest"
)

// A group's queue with 1,000 messages nobody consumed shows 1,000 ready,
// read from the real RabbitMQ; the unacknowledged count comes from the
// management API (a stand-in here: the shared broker runs without the
// management plugin), asked with the AMQP URL's credentials.
func TestLagOfAQueueOnRabbitMQ(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	topic, group := "lag-"+watermill.NewShortUUID(), "billing"
	cfg := transporttest.Config(t, transport.AMQP)
	cfg.AMQP.DeclareGroups = []string{group}
	tr, err := transport.Open(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() {
		_ = tr.Close()
		transporttest.DeleteAMQPTopology(t, []string{topic}, group)
	})
	for i := range 1000 {
		msg := message.NewMessage(watermill.NewUUID(), []byte{byte(i)})
		require.NoError(t, tr.Publisher().Publish(topic, msg))
	}

	var asked string
	mgmt := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, _, _ := r.BasicAuth()
		asked = r.URL.EscapedPath() + " as " + user
		_ = json.NewEncoder(w).Encode(map[string]any{"messages_unacknowledged": 7, "messages_ready": 1000})
	}))
	t.Cleanup(mgmt.Close)
	r, err := amqp.NewLagReader(cfg.AMQP, amqp.LagConfig{Topics: []string{topic}, Groups: []string{group}, ManagementURL: mgmt.URL})
	require.NoError(t, err)
	ps, err := r.Lag(ctx)
	require.NoError(t, err)
	require.Equal(t, []lag.Partition{{Transport: "amqp", Group: group, Topic: amqp.QueueName(topic, group), Partition: lag.NoPartition,
		Committed: -1, End: -1, Lag: 1000, Unacked: 7}}, ps)
	require.Equal(t, "/api/queues/%2F/"+amqp.QueueName(topic, group)+" as guest", asked, "the management API asked about the queue in the URL's vhost")

	// A queue that does not exist is an error naming it; the others'
	// rows still come.
	r, err = amqp.NewLagReader(cfg.AMQP, amqp.LagConfig{Topics: []string{topic}, Groups: []string{group, "nobody"}})
	require.NoError(t, err)
	ps, err = r.Lag(ctx)
	require.ErrorContains(t, err, `queue "`+amqp.QueueName(topic, "nobody")+`"`)
	require.Len(t, ps, 1)
	require.Equal(t, int64(-1), ps[0].Unacked, "without the management API the unacknowledged count is not known")
}
