package gochannel

import (
	"fmt"
	"strings"

	"github.com/millwright/millwright/internal/envparse"
	"github.com/millwright/millwright/transport"
)

// kindSettings is how transport.ParseURL reads the gochannel kind: mem://
// (or gochannel://), with no host or path. It has no environment
// variables.
var kindSettings = transport.Settings{
	Schemes: []string{"mem"},
	Aliases: []string{"gochannel"},
	ParseURL: func(_ *transport.Config, u transport.URL) error {
		if u.Rest != "" && u.Rest != "/" {
			return fmt.Errorf("transport: %s:// takes no host or path (got %q): write mem:// for the in-process gochannel transport", u.Raw[:strings.Index(u.Raw, "://")], envparse.Short(u.Rest))
		}
		return nil
	},
	Describe: func(transport.Config) string { return "mem://" },
}
