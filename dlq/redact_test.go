package dlq_test

import (
	"bytes"
	"fmt"
	"net/url"
	"sync"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/metadata"
)

// A handler error quoting a DSN (net/url and lib/pq parse errors quote the
// whole URL) must not put its password in the dead letter or the logs.
func TestDeadLetterHidesPasswordsInHandlerErrors(t *testing.T) {
	t.Parallel()
	const pw = "Sup3rS3cretPW"
	var logs syncBuf
	_, parseErr := url.Parse("postgres://app:" + pw + "@db:badport/orders")
	require.Error(t, parseErr)
	b := setup(t, dlq.Config{Retry: fastRetry, Logger: watermill.NewStdLoggerWithOut(&logs, true, true)}, nil, func(*message.Message) error {
		return fmt.Errorf("opening ledger: %w", parseErr)
	})
	b.publish(t, `{}`)
	dl := b.nextDead(t)
	require.Contains(t, dl.Metadata.Get(metadata.DeadLetterError), "postgres://app:xxxxx@db:badport/orders",
		"the error stays useful: only the password is hidden")
	for k, v := range dl.Metadata {
		require.NotContains(t, v, pw, "metadata %s", k)
	}
	require.NotEmpty(t, logs.String())
	require.NotContains(t, logs.String(), pw)
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
