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
	const nats Kind = "nats"
	const envNATS = EnvPrefix + "NATS_TEST_URL"
	registerTemporarily(t, nats, Driver{
		Validate: func(Config) error { return nil },
		Open:     func(context.Context, Config) (Backend, error) { return nil, errors.New("not for opening") },
		Settings: Settings{
			Schemes: []string{"nats"},
			Aliases: []string{"nats+tls"},
			ParseURL: func(c *Config, u URL) error {
				if u.Rest == "" {
					return errors.New("transport: nats URL has no server")
				}
				c.AMQP.URL = u.Scheme + "|" + u.Rest // any field: the kind's own
				return nil
			},
			FromEnv: func(c *Config, env Env) error {
				if v := env.Get(envNATS); v != "" {
					c.AMQP.URL = v
					env.From("NATS.URL", envNATS)
				}
				return nil
			},
			Fields:   map[string]func(Config) string{"NATS.URL": func(c Config) string { return c.AMQP.URL }},
			Describe: func(c Config) string { return "nats at " + c.AMQP.URL },
		},
	})

	c, err := ParseURL("NATS+TLS://n1:4222")
	require.NoError(t, err, "a registered kind is valid")
	require.Equal(t, nats, c.Kind)
	require.Equal(t, "nats+tls|n1:4222", c.AMQP.URL)
	require.Equal(t, SourceURL, c.Setting("NATS.URL"))
	require.Equal(t, "nats at nats+tls|n1:4222", c.String())

	_, err = ParseURL("nats://")
	require.EqualError(t, err, "transport: nats URL has no server")
	require.Equal(t, "want one of kafka, amqp, googlecloud, sql, gochannel, nats", "want one of "+kindList())
	_, err = ParseURL("stomp://x")
	require.ErrorContains(t, err, "mem or nats, or a development fake: kfake, pstest", "the unknown-scheme error lists the registered schemes")

	env := map[string]string{EnvTransport: "nats://n2:4222", envNATS: " nats://n3:4222 "}
	c, err = fromLookup(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	require.NoError(t, err)
	require.Equal(t, "nats://n3:4222", c.AMQP.URL, "the kind's FromEnv ran, after its URL")
	require.Equal(t, envNATS, c.Setting("NATS.URL"))
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
	require.Equal(t, "transport: URL has no scheme (not shown: it may hold a password): want kafka://, amqp://, amqps://, gcppubsub://, postgres:// or mem://", err.Error())
	_, fakes := schemeList("")
	require.Equal(t, "kfake, pstest", fakes)
	require.False(t, strings.Contains(err.Error(), " pubsub://"), "aliases are not listed")
}
