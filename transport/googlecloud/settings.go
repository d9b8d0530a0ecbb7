package googlecloud

import (
	"errors"
	"fmt"
	"net/url"

	"github.com/millwright/millwright/internal/envparse"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/transport"
)

// kindSettings is how transport.ParseURL and transport.FromEnv read the
// googlecloud kind: gcppubsub:// and pstest:// URLs and the
// MILLWRIGHT_PUBSUB_* variables.
var kindSettings = transport.Settings{
	Schemes:  []string{"gcppubsub"},
	Aliases:  []string{"pubsub"},
	Fakes:    []transport.Fake{{Name: transport.FakePubSub, Select: func(c *transport.Config) { c.GoogleCloud.Fake = true }}},
	ParseURL: parseURL,
	FromEnv:  fromEnv,
	Fields: map[string]func(transport.Config) string{
		"GoogleCloud.ProjectID":       func(c transport.Config) string { return c.GoogleCloud.ProjectID },
		"GoogleCloud.EmulatorHost":    func(c transport.Config) string { return c.GoogleCloud.EmulatorHost },
		"GoogleCloud.CredentialsFile": func(c transport.Config) string { return c.GoogleCloud.CredentialsFile },
	},
	Describe: describe,
}

func describe(c transport.Config) string {
	if c.GoogleCloud.Fake {
		return "pstest://" + c.GoogleCloud.ProjectID + " (in-process development fake)"
	}
	s := "gcppubsub://" + c.GoogleCloud.ProjectID
	if c.GoogleCloud.EmulatorHost != "" {
		s += "?emulator=" + c.GoogleCloud.EmulatorHost
	}
	return redact.URL(s)
}

func parseURL(c *transport.Config, raw transport.URL) error {
	u, err := url.Parse(raw.Raw)
	if raw.Scheme == transport.FakePubSub {
		if err != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
			return fmt.Errorf("transport: malformed pstest URL: want pstest:// or pstest://PROJECT (the in-process development fake)")
		}
		c.GoogleCloud.Fake = true
		c.GoogleCloud.ProjectID = u.Host
		return nil
	}
	if err != nil {
		return fmt.Errorf("transport: malformed gcppubsub URL: want gcppubsub://PROJECT: %v", redact.Error(err))
	}
	if u.Host == "" {
		return errors.New("transport: gcppubsub URL has no project id: want gcppubsub://PROJECT")
	}
	c.GoogleCloud.ProjectID = u.Host
	c.GoogleCloud.EmulatorHost = u.Query().Get("emulator")
	c.GoogleCloud.CredentialsFile = u.Query().Get("credentials_file")
	return nil
}

// fromEnv reads the MILLWRIGHT_PUBSUB_* variables and
// MILLWRIGHT_DECLARE_GROUPS.
func fromEnv(cfg *transport.Config, env transport.Env) error {
	c := &cfg.GoogleCloud
	var err error
	if v := env.Get(transport.EnvPubSubProject); v != "" {
		c.ProjectID = v
		env.From("GoogleCloud.ProjectID", transport.EnvPubSubProject)
	}
	if v := env.Get(transport.EnvPubSubEmulatorHost); v != "" {
		c.EmulatorHost = v
		env.From("GoogleCloud.EmulatorHost", transport.EnvPubSubEmulatorHost)
	}
	if v := env.Get(transport.EnvPubSubCredentialsFile); v != "" {
		c.CredentialsFile = v
		env.From("GoogleCloud.CredentialsFile", transport.EnvPubSubCredentialsFile)
	}
	if v := env.Get(transport.EnvPubSubAllowUnreceived); v != "" {
		c.AllowUnreceived, err = envparse.Bool(transport.EnvPubSubAllowUnreceived, v)
	}
	if v := env.Get(transport.EnvDeclareGroups); v != "" {
		c.DeclareGroups = envparse.List(v)
	}
	return err
}
