package gochannel

import (
	"context"

	"github.com/millwright/millwright/transport"
)

// Importing this package registers the gochannel kind with package transport
// (transport.Open, ParseURL, FromEnv), as database/sql drivers register
// themselves: a program links only the kinds it imports.
func init() {
	transport.Register(transport.GoChannel, transport.Driver{
		Validate: func(c transport.Config) error { return validate(c.GoChannel) },
		Settings: kindSettings,
		Open: func(ctx context.Context, c transport.Config) (transport.Backend, error) {
			t, err := Open(ctx, c.GoChannel, c.Logger)
			if err != nil {
				return nil, err
			}
			return t, nil
		},
	})
}

var _ transport.Backend = (*Transport)(nil)
