package relayenv_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/cmd/millwright/internal/relayenv"
	"github.com/millwright/millwright/transport"
)

func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestDefaults(t *testing.T) {
	t.Parallel()
	c, err := relayenv.Load(env(map[string]string{relayenv.DatabaseURL: "postgres://db/app"}))
	require.NoError(t, err)
	require.Equal(t, relayenv.Config{
		DatabaseURL: "postgres://db/app", Addr: ":9090", Relays: 1, BatchSize: 500, Workers: 4, PollInterval: time.Second,
		Listen: true, DrainTimeout: 20 * time.Second, Lease: 30 * time.Second, ReadyMaxAge: 30 * time.Second, MaxConns: 8, Driver: "pgx",
		OutboxRetention: 7 * 24 * time.Hour, IdempotencyRetention: 7 * 24 * time.Hour,
		DLQRetention: 90 * 24 * time.Hour, SagaRetention: 30 * 24 * time.Hour, AuditRetention: 365 * 24 * time.Hour,
		CleanInterval: time.Minute,
	}, c)
}

func TestValuesAndDerivedPool(t *testing.T) {
	t.Parallel()
	c, err := relayenv.Load(env(map[string]string{
		relayenv.DatabaseURL: "postgres://db/app", relayenv.Relays: "3", relayenv.Listen: "false",
		relayenv.OutboxRetention: "0", relayenv.DeadLetterTopic: " outbox.dead ",
	}))
	require.NoError(t, err)
	require.Equal(t, 16, c.MaxConns, "4 per relay + 4")
	require.False(t, c.Listen)
	require.Zero(t, c.OutboxRetention, "0 disables the cleaner")
	require.Equal(t, "outbox.dead", c.DeadLetterTopic)

	c, err = relayenv.Load(env(map[string]string{relayenv.DatabaseURL: "x", relayenv.Workers: "8"}))
	require.NoError(t, err)
	require.Equal(t, 8, c.Workers)
	_, err = relayenv.Load(env(map[string]string{relayenv.DatabaseURL: "x", relayenv.Workers: "0", relayenv.BatchSize: "x"}))
	require.ErrorContains(t, err, `MILLWRIGHT_RELAY_WORKERS="0": want an integer in 1..64`)
	require.ErrorContains(t, err, `MILLWRIGHT_RELAY_BATCH_SIZE="x"`, "every invalid variable is reported")

	_, err = relayenv.Load(env(map[string]string{relayenv.DatabaseURL: "x", relayenv.PollInterval: "1m"}))
	require.ErrorContains(t, err, "MILLWRIGHT_RELAY_READY_MAX_AGE 30s must exceed MILLWRIGHT_RELAY_POLL_INTERVAL 1m0s")
}

// Every variable is documented in the help, and Known accepts the
// transport's variables and no others.
func TestHelpAndKnown(t *testing.T) {
	t.Parallel()
	help := relayenv.Help()
	for _, v := range relayenv.Vars {
		require.Contains(t, help, "  "+v.Name+" (")
		require.True(t, relayenv.Known(v.Name))
		require.True(t, strings.HasPrefix(v.Name, transport.EnvPrefix), v.Name)
	}
	require.True(t, relayenv.Known(transport.EnvKafkaBrokers))
	require.False(t, relayenv.Known("MILLWRIGHT_RELAY_DRAIN"))
}

// The driver defaults to pgx, takes pq, and refuses anything else by name.
func TestDriver(t *testing.T) {
	load := func(v string) (relayenv.Config, error) {
		return relayenv.Load(func(k string) (string, bool) {
			switch k {
			case relayenv.DatabaseURL:
				return "postgres://x", true
			case relayenv.Driver:
				return v, v != ""
			}
			return "", false
		})
	}
	c, err := load("")
	if err != nil || c.Driver != "pgx" {
		t.Fatalf("default: %q, %v", c.Driver, err)
	}
	if c, err = load("PQ"); err != nil || c.Driver != "pq" {
		t.Fatalf("pq: %q, %v", c.Driver, err)
	}
	if _, err = load("mysql"); err == nil || !strings.Contains(err.Error(), relayenv.Driver+`="mysql": want pgx or pq`) {
		t.Fatalf("mysql: %v", err)
	}
}
