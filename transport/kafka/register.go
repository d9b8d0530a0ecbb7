package kafka

import (
	"context"

	"github.com/millwright/millwright/transport"
)

// Importing this package registers the kafka kind with package transport
// (transport.Open, ParseURL, FromEnv), as database/sql drivers register
// themselves: a program links only the kinds it imports.
func init() {
	transport.Register(transport.Kafka, transport.Driver{
		Validate: func(c transport.Config) error { return validate(c.Kafka) },
		Settings: kindSettings,
		Open: func(ctx context.Context, c transport.Config) (transport.Backend, error) {
			t, err := open(ctx, c.Kafka, c.Logger, c.Setting)
			if err != nil {
				return nil, err
			}
			return t, nil
		},
		Limits: limits,
	})
}

// limits takes the largest message from the Sarama configuration the
// transport would use: Config.Tune may change Producer.MaxMessageBytes.
func limits(c transport.Config, def transport.Limits) transport.Limits {
	kc := c.Kafka
	setDefaults(&kc)
	sc, err := saramaConfig(kc)
	if err != nil || sc.Producer.MaxMessageBytes == def.MaxBytes {
		return def // an invalid configuration fails Open, not here
	}
	def.MaxBytes = sc.Producer.MaxMessageBytes
	def.Setting = "Sarama's Producer.MaxMessageBytes, set by kafka.Config.Tune (the topic's max.message.bytes must take it too)"
	return def
}

var _ transport.Backend = (*Transport)(nil)
