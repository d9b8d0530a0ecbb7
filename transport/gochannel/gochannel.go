package gochannel

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wgochannel "github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/millwright/millwright/transport"
)

// Config is transport.GoChannelConfig: the settings live in package transport, so that
// a program links only the kinds it imports.
type Config = transport.GoChannelConfig

// Validate reports configuration that cannot work.
func validate(c Config) error {
	if c.Buffer < 0 {
		return errors.New("gochannel: Buffer is negative")
	}
	return nil
}

// Transport is one in-process pub/sub.
type Transport struct{ ps *wgochannel.GoChannel }

// Open creates the in-process pub/sub.
func Open(_ context.Context, cfg Config, logger watermill.LoggerAdapter) (*Transport, error) {
	if err := validate(cfg); err != nil {
		return nil, err
	}
	if cfg.Buffer == 0 {
		cfg.Buffer = 1024
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Transport{ps: wgochannel.NewGoChannel(wgochannel.Config{
		OutputChannelBuffer: cfg.Buffer,
		Persistent:          !cfg.NotPersistent,
	}, logger)}, nil
}

// Publisher returns the pub/sub.
func (t *Transport) Publisher() message.Publisher { return t.ps }

// Subscriber returns the pub/sub; the group is ignored.
func (t *Transport) Subscriber(string) (message.Subscriber, error) { return t.ps, nil }

// Close closes the pub/sub. It is idempotent.
func (t *Transport) Close() error { return t.ps.Close() }
