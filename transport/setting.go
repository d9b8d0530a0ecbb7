package transport

// SourceURL is what Setting names for a value ParseURL took from its
// URL, when the URL did not come from MILLWRIGHT_TRANSPORT.
const SourceURL = "the transport URL"

// source is where FromEnv or ParseURL took one setting from, with the
// value it took (so that a value changed afterwards in code is not
// credited to the environment).
type source struct{ from, value string }

// Setting names where the value of field came from, for error messages
// that tell the user which setting to fix: the environment variable
// FromEnv read it from (MILLWRIGHT_KAFKA_BROKERS, MILLWRIGHT_TRANSPORT for
// a value of the transport URL), SourceURL for ParseURL's URL, or
// "Config.<field>" for a value set in code (or changed after loading).
// field is the Config path of a connection setting: Kafka.Brokers,
// Kafka.SASL (its mechanism turns SASL on), Kafka.TLS, AMQP.URL,
// GoogleCloud.ProjectID, GoogleCloud.EmulatorHost,
// GoogleCloud.CredentialsFile or SQL.URL.
func (c Config) Setting(field string) string {
	if s, ok := c.sources[field]; ok && s.value == c.settingValue(field) {
		return s.from
	}
	return "Config." + field
}

// settingValue is field's value as a comparable string ("" for a field
// no linked kind's Settings.Fields has).
func (c Config) settingValue(field string) string {
	v, _ := fieldValue(c, field)
	return v
}

// setSource records that field's value came from `from`; the value is
// taken by sealSources, once loading is done.
func (c *Config) setSource(field, from string) {
	m := make(map[string]source, len(c.sources)+1)
	for k, v := range c.sources {
		m[k] = v
	}
	m[field] = source{from: from}
	c.sources = m
}

// sealSources records the final value of every field with a source, and
// renames the sources in rename (ParseURL's URL read from the
// environment).
func (c *Config) sealSources(rename map[string]string) {
	m := make(map[string]source, len(c.sources))
	for k, v := range c.sources {
		if to, ok := rename[v.from]; ok {
			v.from = to
		}
		v.value = c.settingValue(k)
		m[k] = v
	}
	c.sources = m
}
