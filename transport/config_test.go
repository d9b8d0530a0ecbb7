package transport_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/transport"
)

func TestParseURL(t *testing.T) {
	t.Parallel()

	cases := []struct {
		url   string
		check func(t *testing.T, c transport.Config)
	}{
		{"kafka://h1:9092,h2:9092", func(t *testing.T, c transport.Config) {
			require.Equal(t, transport.Kafka, c.Kind)
			require.Equal(t, []string{"h1:9092", "h2:9092"}, c.Kafka.Brokers)
			require.Empty(t, c.Kafka.SASL.Mechanism)
			require.Nil(t, c.Kafka.TLS)
		}},
		{"kafka://alice:s3cret@h1:9093?sasl=scram-sha-512&tls=true", func(t *testing.T, c transport.Config) {
			require.Equal(t, "SCRAM-SHA-512", c.Kafka.SASL.Mechanism)
			require.Equal(t, "alice", c.Kafka.SASL.User)
			require.Equal(t, "s3cret", c.Kafka.SASL.Password)
			require.NotNil(t, c.Kafka.TLS)
			require.NotContains(t, c.String(), "s3cret")
		}},
		{"kafka://h1:9092?partitioner=FNV1a", func(t *testing.T, c transport.Config) {
			require.Equal(t, "fnv1a", c.Kafka.Partitioner)
		}},
		{"amqp://guest:guest@localhost:5672/vhost", func(t *testing.T, c transport.Config) {
			require.Equal(t, transport.AMQP, c.Kind)
			require.Equal(t, "amqp://guest:guest@localhost:5672/vhost", c.AMQP.URL)
			require.Equal(t, "amqp://guest:xxxxx@localhost:5672/vhost", c.String())
		}},
		{"amqps://u:p@rabbit:5671/", func(t *testing.T, c transport.Config) {
			require.Equal(t, transport.AMQP, c.Kind)
		}},
		{"gcppubsub://my-project", func(t *testing.T, c transport.Config) {
			require.Equal(t, transport.GoogleCloud, c.Kind)
			require.Equal(t, "my-project", c.GoogleCloud.ProjectID)
		}},
		{"gcppubsub://my-project?emulator=localhost:8085", func(t *testing.T, c transport.Config) {
			require.Equal(t, "localhost:8085", c.GoogleCloud.EmulatorHost)
		}},
		{"postgres://u:pw@localhost:5432/db?sslmode=disable", func(t *testing.T, c transport.Config) {
			require.Equal(t, transport.SQL, c.Kind)
			require.NotContains(t, c.String(), "pw@")
		}},
		{"mem://", func(t *testing.T, c transport.Config) {
			require.Equal(t, transport.GoChannel, c.Kind)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.url, func(t *testing.T) {
			c, err := transport.ParseURL(tc.url)
			require.NoError(t, err)
			tc.check(t, c)
		})
	}
}

func TestBadConfigErrorsNameTheFieldAndHideSecrets(t *testing.T) {
	t.Parallel()

	cases := []struct {
		name string
		cfg  func() (transport.Config, error)
		want string
	}{
		{"unknown kind", func() (transport.Config, error) {
			return transport.Config{Kind: "kafak"}, nil
		}, `invalid transport "kafak": want one of kafka, amqp, googlecloud, sql, gochannel`},
		{"empty kind", func() (transport.Config, error) { return transport.Config{}, nil }, "Kind is empty"},
		{"empty broker list", func() (transport.Config, error) {
			return transport.Config{Kind: transport.Kafka}, nil
		}, "Brokers is empty"},
		{"broker without port", func() (transport.Config, error) {
			c := transport.Config{Kind: transport.Kafka}
			c.Kafka.Brokers = []string{"localhost"}
			return c, nil
		}, `broker address "localhost": want host:port`},
		{"kafka URL without brokers", func() (transport.Config, error) { return transport.ParseURL("kafka://") }, "no brokers"},
		{"missing project id", func() (transport.Config, error) { return transport.ParseURL("gcppubsub://") }, "no project id"},
		{"missing project id in config", func() (transport.Config, error) {
			return transport.Config{Kind: transport.GoogleCloud}, nil
		}, "ProjectID is empty"},
		{"malformed amqp URL with password", func() (transport.Config, error) {
			return transport.ParseURL("amqp://user:hunter2@host:99999999999/%zz")
		}, "malformed amqp URL"},
		{"unknown scheme", func() (transport.Config, error) { return transport.ParseURL("nsq://x") }, `unknown URL scheme "nsq"`},
		{"no scheme", func() (transport.Config, error) { return transport.ParseURL("localhost:9092") }, "has no scheme"},
		{"bad sasl", func() (transport.Config, error) { return transport.ParseURL("kafka://u:hunter2@h:1?sasl=GSSAPI") }, `SASL mechanism "GSSAPI"`},
		{"unknown partitioner", func() (transport.Config, error) {
			return transport.ParseURL("kafka://u:hunter2@h:1?partitioner=crc32")
		}, `Partitioner "crc32": want murmur2 (default, the Java client's) or fnv1a`},
		{"amqp empty URL", func() (transport.Config, error) { return transport.Config{Kind: transport.AMQP}, nil }, "URL is empty"},
		{"sql wrong scheme", func() (transport.Config, error) {
			c := transport.Config{Kind: transport.SQL}
			c.SQL.URL = "mysql://u:hunter2@h/db"
			return c, nil
		}, `URL scheme "mysql": want postgres`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := tc.cfg()
			if err == nil {
				_, err = transport.Open(context.Background(), cfg)
			}
			require.Error(t, err)
			require.Contains(t, err.Error(), tc.want)
			require.NotContains(t, err.Error(), "hunter2")
		})
	}
}

func TestFromEnv(t *testing.T) {
	t.Run("kind and per-kind variables", func(t *testing.T) {
		t.Setenv(transport.EnvTransport, "kafka")
		t.Setenv(transport.EnvKafkaBrokers, "a:9092, b:9092")
		t.Setenv(transport.EnvKafkaSASLMechanism, "plain")
		t.Setenv(transport.EnvKafkaSASLUser, "svc")
		t.Setenv(transport.EnvKafkaSASLPassword, "pw")
		t.Setenv(transport.EnvKafkaPartitioner, "FNV1a")
		c, err := transport.FromEnv()
		require.NoError(t, err)
		require.Equal(t, transport.Kafka, c.Kind)
		require.Equal(t, []string{"a:9092", "b:9092"}, c.Kafka.Brokers)
		require.Equal(t, "PLAIN", c.Kafka.SASL.Mechanism)
		require.Equal(t, "pw", c.Kafka.SASL.Password)
		require.Equal(t, "fnv1a", c.Kafka.Partitioner)
	})
	t.Run("unknown kafka partitioner", func(t *testing.T) {
		t.Setenv(transport.EnvTransport, "kafka")
		t.Setenv(transport.EnvKafkaBrokers, "a:9092")
		t.Setenv(transport.EnvKafkaPartitioner, "murmur3")
		_, err := transport.FromEnv()
		require.ErrorContains(t, err, `Partitioner "murmur3": want murmur2`)
		require.ErrorContains(t, err, "fnv1a")
	})
	t.Run("URL", func(t *testing.T) {
		t.Setenv(transport.EnvTransport, "amqp://guest:guest@127.0.0.1:5672/")
		t.Setenv(transport.EnvAMQPPrefetch, "10")
		t.Setenv(transport.EnvDeclareGroups, "billing,shipping")
		c, err := transport.FromEnv()
		require.NoError(t, err)
		require.Equal(t, transport.AMQP, c.Kind)
		require.Equal(t, 10, c.AMQP.Prefetch)
		require.Equal(t, []string{"billing", "shipping"}, c.AMQP.DeclareGroups)
	})
	t.Run("unreceived publishes fail unless allowed", func(t *testing.T) {
		t.Setenv(transport.EnvTransport, "amqp://guest:guest@127.0.0.1:5672/")
		c, err := transport.FromEnv()
		require.NoError(t, err)
		require.False(t, c.AMQP.AllowUnroutable)
		require.False(t, c.GoogleCloud.AllowUnreceived)
		t.Setenv(transport.EnvAMQPAllowUnroutable, "true")
		t.Setenv(transport.EnvPubSubAllowUnreceived, "1")
		c, err = transport.FromEnv()
		require.NoError(t, err)
		require.True(t, c.AMQP.AllowUnroutable)
		require.True(t, c.GoogleCloud.AllowUnreceived)
		t.Setenv(transport.EnvAMQPAllowUnroutable, "yes please")
		_, err = transport.FromEnv()
		require.ErrorContains(t, err, transport.EnvAMQPAllowUnroutable+`="yes please": want true or false`)
	})
	t.Run("sql falls back to the database URL", func(t *testing.T) {
		t.Setenv(transport.EnvTransport, "sql")
		t.Setenv(transport.EnvSQLURL, "")
		t.Setenv(transport.EnvDatabaseURL, "postgres://x@h/db")
		c, err := transport.FromEnv()
		require.NoError(t, err)
		require.Equal(t, "postgres://x@h/db", c.SQL.URL)
	})
	t.Run("unset", func(t *testing.T) {
		t.Setenv(transport.EnvTransport, "")
		_, err := transport.FromEnv()
		require.ErrorContains(t, err, transport.EnvTransport)
	})
	t.Run("typo", func(t *testing.T) {
		t.Setenv(transport.EnvTransport, "rabbit")
		_, err := transport.FromEnv()
		require.ErrorContains(t, err, `invalid transport "rabbit": want one of`)
	})
	t.Run("bad number", func(t *testing.T) {
		t.Setenv(transport.EnvTransport, "amqp")
		t.Setenv(transport.EnvAMQPURL, "amqp://127.0.0.1:5672/")
		t.Setenv(transport.EnvAMQPPrefetch, "many")
		_, err := transport.FromEnv()
		require.ErrorContains(t, err, transport.EnvAMQPPrefetch)
	})
}

// deadAddr returns a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// silentAddr returns an address that accepts TCP connections and never
// answers, the hardest case for a bounded connect.
func silentAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	return l.Addr().String()
}

func TestUnreachableBrokerFailsWithinBound(t *testing.T) {
	t.Parallel()

	const bound = 10 * time.Second
	for _, mk := range []struct {
		name string
		addr func(*testing.T) string
	}{{"refused", deadAddr}, {"silent", silentAddr}} {
		for _, kind := range transport.Kinds {
			if kind == transport.GoChannel {
				continue
			}
			t.Run(mk.name+"/"+string(kind), func(t *testing.T) {
				t.Parallel()
				addr := mk.addr(t)
				var cfg transport.Config
				var err error
				switch kind {
				case transport.Kafka:
					cfg, err = transport.ParseURL("kafka://" + addr)
				case transport.AMQP:
					cfg, err = transport.ParseURL("amqp://guest:hunter2@" + addr + "/")
				case transport.GoogleCloud:
					cfg, err = transport.ParseURL("gcppubsub://p-project?emulator=" + addr)
				case transport.SQL:
					cfg, err = transport.ParseURL("postgres://u:hunter2@" + addr + "/db?sslmode=disable")
				case transport.NATS:
					cfg, err = transport.ParseURL("nats://u:hunter2@" + addr)
				}
				require.NoError(t, err)
				cfg.Kafka.ConnectTimeout = 3 * time.Second
				cfg.AMQP.ConnectTimeout = 3 * time.Second
				cfg.GoogleCloud.ConnectTimeout = 3 * time.Second
				cfg.SQL.ConnectTimeout = 3 * time.Second
				cfg.NATS.ConnectTimeout = 3 * time.Second
				cfg.WaitForBroker = transport.NoWait // one attempt: its bound is what is tested
				start := time.Now()
				tr, err := transport.Open(context.Background(), cfg)
				if err == nil {
					tr.Close()
				}
				require.Error(t, err)
				require.Less(t, time.Since(start), bound, "Open must give up within %s", bound)
				require.NotContains(t, err.Error(), "hunter2")
				require.True(t, strings.Contains(err.Error(), "check") || strings.Contains(err.Error(), "did not answer"), err.Error())
			})
		}
	}
}
