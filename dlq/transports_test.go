//go:build transports

// Runs dlqtest.TestPoisonDoesNotBlock on every transport kind through the
// transport package (embedded kfake and pstest, local RabbitMQ and
// Postgres). Behind a build tag until the transport package is committed:
//
//	go test -tags transports -run TestPoisonDoesNotBlockAllTransports ./dlq/
package dlq_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq/dlqtest"
	"github.com/millwright/millwright/internal/pgtest"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/embedded"
)

func TestPoisonDoesNotBlockAllTransports(t *testing.T) {
	kc, err := embedded.Kafka()
	require.NoError(t, err)
	ps, err := embedded.PubSub()
	require.NoError(t, err)
	schema := pgtest.New(t)
	amqpCfg := transport.Config{Kind: transport.AMQP}
	amqpCfg.AMQP.URL = "amqp://guest:guest@127.0.0.1:5672/"
	sqlCfg := transport.Config{Kind: transport.SQL}
	sqlCfg.SQL.DB = schema.DB
	cfgs := map[string]transport.Config{
		"gochannel":   {Kind: transport.GoChannel},
		"kafka":       kc.Config(),
		"googlecloud": ps.Config(),
		"amqp":        amqpCfg,
		"sql":         sqlCfg,
	}
	for _, name := range []string{"gochannel", "sql", "amqp", "googlecloud", "kafka"} {
		cfg := cfgs[name]
		t.Run(name, func(t *testing.T) {
			start := time.Now()
			tr, err := transport.Open(context.Background(), cfg)
			require.NoError(t, err)
			t.Cleanup(func() { _ = tr.Close() })
			sub, err := tr.Subscriber("dlqtest")
			require.NoError(t, err)
			dlqtest.TestPoisonDoesNotBlock(t, tr.Publisher(), sub, fmt.Sprintf("poison_%s_%d", name, time.Now().UnixNano()%1e6))
			t.Logf("%s: %s", name, time.Since(start))
		})
	}
}
