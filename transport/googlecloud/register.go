package googlecloud

import (
	"context"

	"github.com/millwright/millwright/transport"
)

// Importing this package registers the googlecloud kind with package transport
// (transport.Open, ParseURL, FromEnv), as database/sql drivers register
// themselves: a program links only the kinds it imports.
func init() {
	transport.Register(transport.GoogleCloud, transport.Driver{
		Validate: func(c transport.Config) error { return validate(c.GoogleCloud) },
		Settings: kindSettings,
		Open: func(ctx context.Context, c transport.Config) (transport.Backend, error) {
			t, err := open(ctx, c.GoogleCloud, c.Logger, c.Setting)
			if err != nil {
				return nil, err
			}
			return t, nil
		},
	})
}

var _ transport.Backend = (*Transport)(nil)
