package relayenv_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cmd/millwright/internal/relayenv"
)

// The lanes' lease is an operator's setting: it bounds every batch's
// publish, so a broker slower than 0.4 x 30s needs a longer one.
func TestLease(t *testing.T) {
	t.Parallel()
	c, err := relayenv.Load(env(map[string]string{relayenv.DatabaseURL: "postgres://db/app", relayenv.Lease: "2m"}))
	require.NoError(t, err)
	require.Equal(t, 2*time.Minute, c.Lease)
	_, err = relayenv.Load(env(map[string]string{relayenv.DatabaseURL: "postgres://db/app", relayenv.Lease: "10ms"}))
	require.ErrorContains(t, err, relayenv.Lease)
}
