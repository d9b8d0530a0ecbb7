package nats

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/transport"
)

// kindSettings is how transport.ParseURL and transport.FromEnv read the
// nats kind: nats:// URLs and the MILLWRIGHT_NATS_* variables.
var kindSettings = transport.Settings{
	Schemes:  []string{"nats"},
	ParseURL: parseURL,
	FromEnv:  fromEnv,
	Fields: map[string]func(transport.Config) string{
		"NATS.URL": func(c transport.Config) string { return c.NATS.URL },
	},
	Describe: func(c transport.Config) string { return describeURL(c.NATS.URL) },
}

// describeURL shows each server of a comma-separated URL list without its
// password.
func describeURL(raw string) string {
	parts := strings.Split(raw, ",")
	for i, p := range parts {
		parts[i] = redact.URL(strings.TrimSpace(p))
	}
	return strings.Join(parts, ",")
}

func parseURL(c *transport.Config, u transport.URL) error {
	for _, s := range strings.Split(u.Raw, ",") {
		pu, err := url.Parse(strings.TrimSpace(s))
		if err != nil || pu.Host == "" {
			return errors.New("transport: malformed nats URL (not shown: it may hold a password): want nats://host:4222 (several servers comma-separated)")
		}
	}
	c.NATS.URL = u.Raw
	return nil
}

// fromEnv reads the MILLWRIGHT_NATS_* variables.
func fromEnv(cfg *transport.Config, env transport.Env) error {
	c := &cfg.NATS
	var errs []error
	if v := env.Get(transport.EnvNATSURL); v != "" {
		c.URL = v
		env.From("NATS.URL", transport.EnvNATSURL)
	}
	if v := env.Get(transport.EnvNATSKeyParallelism); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			errs = append(errs, fmt.Errorf("%s=%q: want a non-negative integer (0: one message at a time per subscription)", transport.EnvNATSKeyParallelism, v))
		}
		c.KeyParallelism = n
	}
	if v := env.Get(transport.EnvNATSAckWait); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < time.Second {
			errs = append(errs, fmt.Errorf("%s=%q: want a duration of at least 1s, such as 30s", transport.EnvNATSAckWait, v))
		}
		c.AckWait = d
	}
	return errors.Join(errs...)
}
