package nats

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/millwright/millwright/transport"
)

// Config is the nats kind's settings (transport.NATSConfig).
type Config = transport.NATSConfig

// Defaults of Config's fields (see transport.NATSConfig).
const (
	DefaultAckWait         = 30 * time.Second
	DefaultMaxAckPending   = 1000
	DefaultDuplicateWindow = 2 * time.Minute
	DefaultMaxAge          = 7 * 24 * time.Hour
	DefaultConnectTimeout  = 10 * time.Second
	DefaultKeyDrainTimeout = 30 * time.Second
)

// Importing this package registers the nats kind with package transport
// (transport.Open, ParseURL, FromEnv), as database/sql drivers register
// themselves: a program links only the kinds it imports.
func init() {
	transport.Register(transport.NATS, transport.Driver{
		Validate: func(c transport.Config) error { return validate(c.NATS) },
		Settings: kindSettings,
		Open: func(ctx context.Context, c transport.Config) (transport.Backend, error) {
			t, err := open(ctx, c.NATS, c.Logger, c.Setting("NATS.URL"))
			if err != nil {
				return nil, err
			}
			return t, nil
		},
		Limits: limits,
	})
}

// limits takes the largest message from Config.MaxPayload (Open refuses
// a larger one than the server's max_payload).
func limits(c transport.Config, def transport.Limits) transport.Limits {
	if c.NATS.MaxPayload > 0 {
		def.MaxBytes = c.NATS.MaxPayload
		def.Setting = "nats.Config.MaxPayload (the server's max_payload must be at least as large)"
	}
	return def
}

func setDefaults(c *Config) {
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.MaxAge == 0 {
		c.MaxAge = DefaultMaxAge
	}
	if c.DuplicateWindow == 0 {
		c.DuplicateWindow = DefaultDuplicateWindow
	}
	if c.AckWait == 0 {
		c.AckWait = DefaultAckWait
	}
	if c.MaxAckPending == 0 {
		c.MaxAckPending = max(DefaultMaxAckPending, 16*c.KeyParallelism)
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = -1
	}
	if c.KeyDrainTimeout == 0 {
		c.KeyDrainTimeout = DefaultKeyDrainTimeout
	}
	if c.MaxPayload == 0 {
		c.MaxPayload = transport.NATSMaxMessageBytes
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = DefaultConnectTimeout
	}
}

// validate reports settings that cannot work, naming the field and the fix.
func validate(c Config) error {
	setDefaults(&c)
	var errs []error
	if c.URL == "" {
		errs = append(errs, fmt.Errorf("nats: URL is empty: set nats.Config.URL or %s (nats://host:4222)", transport.EnvNATSURL))
	}
	if c.Replicas < 1 || c.Replicas > 5 {
		errs = append(errs, fmt.Errorf("nats: Replicas %d: want 1 to 5 (JetStream's limit)", c.Replicas))
	}
	if c.MaxAge < -1 {
		errs = append(errs, fmt.Errorf("nats: MaxAge %s: want a positive duration, 0 (7 days) or -1 (forever)", c.MaxAge))
	}
	if c.DuplicateWindow < 0 || (c.MaxAge > 0 && c.DuplicateWindow > c.MaxAge) {
		errs = append(errs, fmt.Errorf("nats: DuplicateWindow %s: want a positive duration no longer than MaxAge (%s)", c.DuplicateWindow, c.MaxAge))
	}
	if c.AckWait < time.Second {
		errs = append(errs, fmt.Errorf("nats: AckWait %s: want at least 1s (the in-progress acknowledgements go every AckWait/3)", c.AckWait))
	}
	if c.KeyParallelism < 0 {
		errs = append(errs, fmt.Errorf("nats: KeyParallelism %d: want 0 (one message at a time) or more", c.KeyParallelism))
	}
	if c.MaxAckPending < max(1, c.KeyParallelism) {
		errs = append(errs, fmt.Errorf("nats: MaxAckPending %d is below KeyParallelism %d: want at least KeyParallelism (default 16 × KeyParallelism, at least 1,000)", c.MaxAckPending, c.KeyParallelism))
	}
	switch {
	case c.MaxDeliver < -1 || c.MaxDeliver == 1:
		errs = append(errs, fmt.Errorf("nats: MaxDeliver %d: want -1 (no limit, the default) or at least 2", c.MaxDeliver))
	case c.MaxDeliver > 1 && c.DeadLetterTopic == "":
		errs = append(errs, fmt.Errorf("nats: MaxDeliver %d without DeadLetterTopic: the server would drop a message at its last delivery; set DeadLetterTopic, or MaxDeliver -1", c.MaxDeliver))
	}
	if c.DeadLetterTopic != "" {
		if err := transport.ValidateName(transport.NATS, "DeadLetterTopic", c.DeadLetterTopic); err != nil {
			errs = append(errs, err)
		}
	}
	if c.KeyDrainTimeout < 0 {
		errs = append(errs, fmt.Errorf("nats: KeyDrainTimeout %s: want a positive duration", c.KeyDrainTimeout))
	}
	if c.MaxPayload < 0 {
		errs = append(errs, fmt.Errorf("nats: MaxPayload %d: want a positive size in bytes (default 1 MiB)", c.MaxPayload))
	}
	if c.ConnectTimeout < 0 {
		errs = append(errs, fmt.Errorf("nats: ConnectTimeout %s: want a positive duration", c.ConnectTimeout))
	}
	return errors.Join(errs...)
}

var _ transport.Backend = (*Transport)(nil)
