package transport_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"cloud.google.com/go/pubsub"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"
	"google.golang.org/api/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/millwright/millwright/cloudevent"
	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// ceMessage carries every CloudEvents attribute millwright uses, plus keys
// that must pass through untouched.
func ceMessage() *message.Message {
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"o-1"}`))
	cloudevent.Attributes{
		ID: "evt-" + msg.UUID, Source: "/orders-service", Type: "order.created.v1",
		Time:    time.Date(2026, 3, 4, 5, 6, 7, 890000000, time.UTC),
		Subject: "order-1", DataContentType: "application/json; charset=utf-8",
	}.Apply(msg)
	msg.Metadata.Set(metadata.TraceParent, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	msg.Metadata.Set(metadata.OrderingKey, "order/order-1")
	msg.Metadata.Set("x_custom", "kept")
	return msg
}

// wireCheck inspects, after the publish, the message as the broker holds it.
type wireCheck func(t *testing.T, topic string, sent *message.Message)

// TestCloudEventsBinaryMode publishes a message with every CloudEvents
// attribute through each kind, checks the broker-level form where it can be
// observed (Kafka headers, AMQP application properties and content-type,
// Pub/Sub attributes, the SQL row's metadata) and that the consumer gets
// the same metadata back.
func TestCloudEventsBinaryMode(t *testing.T) {
	t.Parallel()
	kinds := map[transport.Kind]func(t *testing.T) (transport.Config, wireCheck){
		transport.Kafka: func(t *testing.T) (transport.Config, wireCheck) {
			cfg := transporttest.Config(t, transport.Kafka)
			return cfg, func(t *testing.T, topic string, sent *message.Message) {
				cl, err := kgo.NewClient(kgo.SeedBrokers(cfg.Kafka.Brokers...), kgo.ConsumeTopics(topic),
					kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
				require.NoError(t, err)
				defer cl.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				for {
					fs := cl.PollFetches(ctx)
					require.NoError(t, ctx.Err(), "no record read back from Kafka topic %s", topic)
					var got map[string]string
					fs.EachRecord(func(r *kgo.Record) {
						got = map[string]string{}
						for _, h := range r.Headers {
							got[h.Key] = string(h.Value)
						}
						require.Equal(t, "order/order-1", string(r.Key))
					})
					if got == nil {
						continue
					}
					require.Equal(t, sent.Metadata.Get(metadata.EventID), got["ce_id"])
					require.Equal(t, "application/json; charset=utf-8", got["content-type"])
					require.NotContains(t, got, "ce_datacontenttype")
					for _, a := range []string{"ce_source", "ce_type", "ce_specversion", "ce_time", "ce_subject"} {
						require.Equal(t, sent.Metadata.Get(a), got[a], a)
					}
					return
				}
			}
		},
		transport.AMQP: func(t *testing.T) (transport.Config, wireCheck) {
			cfg := transporttest.Config(t, transport.AMQP)
			// The raw queue must be bound before the publish: bind it
			// when the check is set up (the exchange exists after Subscribe).
			return cfg, func(t *testing.T, topic string, sent *message.Message) {
				conn, err := amqp091.Dial(cfg.AMQP.URL)
				require.NoError(t, err)
				defer conn.Close()
				ch, err := conn.Channel()
				require.NoError(t, err)
				q := topic + "_raw"
				d, ok, err := ch.Get(q, true)
				require.NoError(t, err)
				require.True(t, ok, "raw queue %s is empty", q)
				require.Equal(t, "application/json; charset=utf-8", d.ContentType)
				require.Equal(t, sent.Metadata.Get(metadata.EventID), d.Headers["cloudEvents:id"])
				for _, a := range []string{"source", "type", "specversion", "time", "subject"} {
					require.Equal(t, sent.Metadata.Get("ce_"+a), d.Headers["cloudEvents:"+a], a)
				}
				for k := range d.Headers {
					require.NotRegexp(t, `^ce_`, k, "a ce_ key leaked onto AMQP")
				}
			}
		},
		transport.GoogleCloud: func(t *testing.T) (transport.Config, wireCheck) {
			cfg := transporttest.Config(t, transport.GoogleCloud)
			// Read back with Google's own client through a subscription of
			// our own, created (in bindRawSubscription) before the publish.
			return cfg, func(t *testing.T, topic string, sent *message.Message) {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				cl := rawPubSubClient(t, cfg)
				var got *pubsub.Message
				rctx, stop := context.WithCancel(ctx)
				err := cl.Subscription(topic+"_raw").Receive(rctx, func(_ context.Context, m *pubsub.Message) {
					m.Ack()
					got = m
					stop()
				})
				require.NoError(t, err)
				require.NotNil(t, got, "no message read back from Pub/Sub subscription %s_raw within 30s", topic)
				attrs := got.Attributes
				require.Equal(t, sent.Metadata.Get(metadata.EventID), attrs["ce-id"])
				require.Equal(t, "application/json; charset=utf-8", attrs["Content-Type"])
				for _, a := range []string{"source", "type", "specversion", "time", "subject"} {
					require.Equal(t, sent.Metadata.Get("ce_"+a), attrs["ce-"+a], a)
				}
				require.Equal(t, "order/order-1", got.OrderingKey)
			}
		},
		transport.SQL: func(t *testing.T) (transport.Config, wireCheck) {
			schema := pgtest.New(t)
			return sqlConfig(schema.DB), func(t *testing.T, topic string, sent *message.Message) {
				// No CloudEvents binding exists for SQL: the row keeps
				// the metadata keys as they are.
				var raw []byte
				require.NoError(t, schema.DB.QueryRow(fmt.Sprintf(`SELECT metadata FROM "watermill_%s"`, topic)).Scan(&raw))
				var md map[string]string
				require.NoError(t, json.Unmarshal(raw, &md))
				require.Equal(t, map[string]string(sent.Metadata), md)
			}
		},
		transport.GoChannel: func(t *testing.T) (transport.Config, wireCheck) {
			return transport.Config{Kind: transport.GoChannel}, nil // no wire
		},
	}
	for kind, setup := range kinds {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			cfg, check := setup(t)
			tr, err := transport.Open(context.Background(), cfg)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tr.Close() })
			sub, err := tr.Subscriber("cegroup")
			require.NoError(t, err)
			topic := "ce_" + watermill.NewShortUUID()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			switch kind {
			case transport.AMQP:
				bindRawQueue(t, cfg.AMQP.URL, topic)
			case transport.GoogleCloud:
				bindRawSubscription(t, cfg, topic)
			}

			sent := ceMessage()
			require.NoError(t, tr.Publisher().Publish(topic, sent))
			var got *message.Message
			select {
			case got = <-msgs:
				got.Ack()
			case <-ctx.Done():
				t.Fatalf("%s: message not consumed from %s", kind, topic)
			}
			require.NoError(t, cloudevent.Validate(got))
			for k, v := range sent.Metadata {
				require.Equal(t, v, got.Metadata.Get(k), "%s: metadata %s after the round trip", kind, k)
			}
			require.Equal(t, sent.UUID, got.UUID)
			if check != nil {
				check(t, topic, sent)
			}
		})
	}
}

// bindRawQueue binds a queue of our own to the topic's exchange so the
// test can read the published AMQP message as RabbitMQ holds it.
func bindRawQueue(t *testing.T, url, topic string) {
	conn, err := amqp091.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	q := topic + "_raw"
	_, err = ch.QueueDeclare(q, false, true, false, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind(q, "", topic, false, nil))
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(q, false, false, false)
		_, _ = ch.QueueDelete(topic+"_cegroup", false, false, false)
		_ = ch.ExchangeDelete(topic, false, false)
	})
}

// rawPubSubClient is Google's own Pub/Sub client on the emulator (or
// pstest) the transport uses, closed at cleanup.
func rawPubSubClient(t *testing.T, cfg transport.Config) *pubsub.Client {
	cl, err := pubsub.NewClient(context.Background(), cfg.GoogleCloud.ProjectID,
		option.WithEndpoint(cfg.GoogleCloud.EmulatorHost), option.WithoutAuthentication(),
		option.WithGRPCDialOption(grpc.WithTransportCredentials(insecure.NewCredentials())))
	require.NoError(t, err)
	t.Cleanup(func() { _ = cl.Close() })
	return cl
}

// bindRawSubscription creates a subscription of our own on the topic (which
// exists once the transport has subscribed) so the test can read the
// published message as Pub/Sub holds it.
func bindRawSubscription(t *testing.T, cfg transport.Config, topic string) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := rawPubSubClient(t, cfg)
	sub, err := cl.CreateSubscription(ctx, topic+"_raw", pubsub.SubscriptionConfig{
		Topic: cl.Topic(topic), EnableMessageOrdering: true,
	})
	require.NoError(t, err, "creating subscription %s_raw", topic)
	t.Cleanup(func() { _ = sub.Delete(context.Background()) })
}
