package transport

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// registerTemporarily registers kind with d for the test and removes it
// (and its schemes) afterwards. Not parallel: Registered and the
// scheme lists are seen by every test.
func registerTemporarily(t *testing.T, kind Kind, d Driver) {
	Register(kind, d)
	t.Cleanup(func() {
		driversMu.Lock()
		defer driversMu.Unlock()
		delete(drivers, kind)
		for name, sc := range schemes {
			if sc.kind == kind {
				delete(schemes, name)
			}
		}
	})
}

// A kind outside this package brings its URL form, environment variables,
// traced settings and description through its Settings alone: ParseURL,
// FromEnv, Config.Setting and Config.String dispatch to it.
func TestSettingsOfARegisteredKind(t *testing.T) {
	const nsq Kind = "nsq"
	const envNSQ = EnvPrefix + "NSQ_TEST_URL"
	registerTemporarily(t, nsq, Driver{
		Validate: func(Config) error { return nil },
		Open:     func(context.Context, Config) (Backend, error) { return nil, errors.New("not for opening") },
		Settings: Settings{
			Schemes: []string{"nsq"},
			Aliases: []string{"nsq+tls"},
			ParseURL: func(c *Config, u URL) error {
				if u.Rest == "" {
					return errors.New("transport: nsq URL has no server")
				}
				c.AMQP.URL = u.Scheme + "|" + u.Rest // any field: the kind's own
				return nil
			},
			FromEnv: func(c *Config, env Env) error {
				if v := env.Get(envNSQ); v != "" {
					c.AMQP.URL = v
					env.From("NSQ.URL", envNSQ)
				}
				return nil
			},
			Fields:   map[string]func(Config) string{"NSQ.URL": func(c Config) string { return c.AMQP.URL }},
			Describe: func(c Config) string { return "nsq at " + c.AMQP.URL },
		},
	})

	c, err := ParseURL("NSQ+TLS://n1:4150")
	require.NoError(t, err, "a registered kind is valid")
	require.Equal(t, nsq, c.Kind)
	require.Equal(t, "nsq+tls|n1:4150", c.AMQP.URL)
	require.Equal(t, SourceURL, c.Setting("NSQ.URL"))
	require.Equal(t, "nsq at nsq+tls|n1:4150", c.String())

	_, err = ParseURL("nsq://")
	require.EqualError(t, err, "transport: nsq URL has no server")
	require.Equal(t, "want one of kafka, amqp, googlecloud, sql, gochannel, nats, nsq", "want one of "+kindList())
	_, err = ParseURL("stomp://x")
	require.ErrorContains(t, err, "mem, nats or nsq, or a development fake: kfake, pstest", "the unknown-scheme error lists the registered schemes")

	env := map[string]string{EnvTransport: "nsq://n2:4150", envNSQ: " nsq://n3:4150 "}
	c, err = fromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	require.NoError(t, err)
	require.Equal(t, "nsq://n3:4150", c.AMQP.URL, "the kind's FromEnv ran, after its URL")
	require.Equal(t, envNSQ, c.Setting("NSQ.URL"))
}

// Two kinds cannot claim one scheme: the second registration panics, as
// registering a kind twice does.
func TestRegisterRefusesASchemeTwice(t *testing.T) {
	require.PanicsWithValue(t, `transport: Register other: scheme "kafka" is registered by kind kafka`, func() {
		registerTemporarily(t, "other", Driver{
			Validate: func(Config) error { return nil },
			Open:     func(context.Context, Config) (Backend, error) { return nil, nil },
			Settings: Settings{Schemes: []string{"KAFKA"}, ParseURL: func(*Config, URL) error { return nil }},
		})
	})
}

// The URL scheme list of errors comes from the registered kinds, in
// documentation order whatever order their packages registered in.
func TestSchemeListFollowsKinds(t *testing.T) {
	t.Parallel()
	err := errNoScheme()
	require.Equal(t, "transport: URL has no scheme (not shown: it may hold a password): want kafka://, amqp://, amqps://, gcppubsub://, postgres://, mem:// or nats://", err.Error())
	_, fakes := schemeList("")
	require.Equal(t, "kfake, pstest", fakes)
	require.False(t, strings.Contains(err.Error(), " pubsub://"), "aliases are not listed")
}
