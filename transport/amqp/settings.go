package amqp

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"

	"github.com/millwright/millwright/internal/envparse"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/transport"
)

// kindSettings is how transport.ParseURL and transport.FromEnv read the
// amqp kind: amqp:// and amqps:// URLs and the MILLWRIGHT_AMQP_*
// variables.
var kindSettings = transport.Settings{
	Schemes:  []string{"amqp", "amqps"},
	ParseURL: parseURL,
	FromEnv:  fromEnv,
	Fields: map[string]func(transport.Config) string{
		"AMQP.URL": func(c transport.Config) string { return c.AMQP.URL },
	},
	Describe: func(c transport.Config) string { return redact.URL(c.AMQP.URL) },
}

func parseURL(c *transport.Config, u transport.URL) error {
	if _, err := url.Parse(u.Raw); err != nil {
		return errors.New("transport: malformed amqp URL (not shown: it may hold a password): want amqp://user:pass@host:5672/vhost")
	}
	c.AMQP.URL = u.Raw
	return nil
}

// fromEnv reads the MILLWRIGHT_AMQP_* variables and
// MILLWRIGHT_DECLARE_GROUPS.
func fromEnv(cfg *transport.Config, env transport.Env) error {
	c := &cfg.AMQP
	var errs []error
	if v := env.Get(transport.EnvAMQPURL); v != "" {
		c.URL = v
		env.From("AMQP.URL", transport.EnvAMQPURL)
	}
	if v := env.Get(transport.EnvAMQPPrefetch); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			errs = append(errs, fmt.Errorf("%s=%q: want a positive integer", transport.EnvAMQPPrefetch, v))
		}
		c.Prefetch = n
	}
	if v := env.Get(transport.EnvAMQPKeyParallelism); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			errs = append(errs, fmt.Errorf("%s=%q: want a non-negative integer (0: watermill-amqp's subscriber, one delivery at a time)", transport.EnvAMQPKeyParallelism, v))
		}
		c.KeyParallelism = n
	}
	if v := env.Get(transport.EnvAMQPAllowUnroutable); v != "" {
		b, err := envparse.Bool(transport.EnvAMQPAllowUnroutable, v)
		errs = append(errs, err)
		c.AllowUnroutable = b
	}
	if v := env.Get(transport.EnvDeclareGroups); v != "" {
		c.DeclareGroups = envparse.List(v)
	}
	return errors.Join(errs...)
}
