package transport

import (
	"errors"
	"fmt"
	"sort"
	"strings"
)

// Settings is how one kind reads its configuration: its URL form, its
// MILLWRIGHT_ variables, the connection settings Config.Setting traces
// and its description. Each kind's sub-package declares them
// (transport/<kind>/settings.go) and registers them with its Driver, so
// that ParseURL and FromEnv only dispatch to the kinds linked into the
// program, and a new kind brings its own.
//
// The settings' types (KafkaConfig, AMQPConfig, ...) stay in this package:
// Config holds every kind's settings by value, and the kind packages
// import this one (the registry), so the types cannot live there without
// an import cycle; each kind package names its type Config by alias.
type Settings struct {
	// Schemes are the URL schemes ParseURL hands to the kind, in the
	// order its error messages list them.
	Schemes []string
	// Aliases are further schemes ParseURL hands to the kind, not listed.
	Aliases []string
	// Fakes are the kind's development fakes: each name selects the fake
	// as a value of MILLWRIGHT_TRANSPORT and, as a scheme (name://), is
	// handed to ParseURL.
	Fakes []Fake
	// ParseURL fills c (whose Kind is already the kind's) from u. Its
	// errors start with "transport: " and never show a password.
	ParseURL func(c *Config, u URL) error
	// FromEnv fills c from the kind's environment variables, recording
	// with Env.From where each connection setting came from. Every linked
	// kind's FromEnv runs, whichever kind is selected (a program may read
	// another kind's settings from the same Config). Its errors name the
	// variable.
	FromEnv func(c *Config, env Env) error
	// Fields are the kind's connection settings Config.Setting traces
	// (Config paths such as "Kafka.Brokers"), each with its value as a
	// comparable string. A URL of the kind gives all of them.
	Fields map[string]func(Config) string
	// Describe is Config.String for the kind: no secrets.
	Describe func(Config) string
}

// Fake is a development fake of a kind (see FakeKafka).
type Fake struct {
	// Name is the MILLWRIGHT_TRANSPORT value and URL scheme of the fake.
	Name string
	// Select turns the fake on in c, for MILLWRIGHT_TRANSPORT=Name.
	Select func(c *Config)
}

// URL is a transport URL as ParseURL hands it to a kind.
type URL struct {
	// Raw is the whole URL as given.
	Raw string
	// Scheme is the scheme, lower-cased.
	Scheme string
	// Rest is what follows "://".
	Rest string
}

// Env reads the environment for a kind's Settings.FromEnv.
type Env struct {
	lookup func(string) (string, bool)
	cfg    *Config
}

// Get returns the variable's value with surrounding blanks trimmed, ""
// when it is unset.
func (e Env) Get(name string) string {
	v, _ := e.lookup(name)
	return strings.TrimSpace(v)
}

// Lookup returns the variable's value as it is (a password's blanks are
// its own), and whether it is set.
func (e Env) Lookup(name string) (string, bool) { return e.lookup(name) }

// From records that the connection setting field (one of the kind's
// Settings.Fields) took its value from variable name, for Config.Setting.
func (e Env) From(field, name string) { e.cfg.setSource(field, name) }

// builtinKinds names the kind of each built-in scheme and fake, so that
// ParseURL and FromEnv can name the import that a program lacks (see
// driverPackages); the kinds' own Settings are what parses them.
var builtinKinds = map[string]Kind{
	"kafka": Kafka, FakeKafka: Kafka,
	"amqp": AMQP, "amqps": AMQP,
	"gcppubsub": GoogleCloud, "pubsub": GoogleCloud, FakePubSub: GoogleCloud,
	"postgres": SQL, "postgresql": SQL,
	"mem": GoChannel, "gochannel": GoChannel,
	"nats": NATS,
}

// scheme is a URL scheme or fake name registered by a kind.
type scheme struct {
	kind Kind
	fake *Fake // nil for a URL scheme that is not a fake's
}

var schemes = map[string]scheme{} // guarded by driversMu

// registerSettings records s's schemes and fakes for kind; driversMu is
// held. A scheme registered twice is a programming error: it panics, as
// Register does.
func registerSettings(kind Kind, s Settings) {
	add := func(name string, f *Fake) {
		name = strings.ToLower(name)
		if prev, dup := schemes[name]; dup {
			panic(fmt.Sprintf("transport: Register %s: scheme %q is registered by kind %s", kind, name, prev.kind))
		}
		schemes[name] = scheme{kind: kind, fake: f}
	}
	if s.ParseURL == nil && len(s.Schemes)+len(s.Aliases)+len(s.Fakes) > 0 {
		panic("transport: Register " + string(kind) + ": Settings with schemes but no ParseURL")
	}
	for _, n := range append(append([]string{}, s.Schemes...), s.Aliases...) {
		add(n, nil)
	}
	for i := range s.Fakes {
		add(s.Fakes[i].Name, &s.Fakes[i])
	}
}

// linkedSettings returns the registered kinds' Settings in documentation
// order (Kinds, then any other kind by name), so that errors join in the
// same order whichever order the packages were initialised in.
func linkedSettings() []Settings {
	driversMu.RLock()
	defer driversMu.RUnlock()
	kinds := make([]Kind, 0, len(drivers))
	for k := range drivers {
		kinds = append(kinds, k)
	}
	sort.Slice(kinds, func(i, j int) bool {
		a, b := kindOrder(kinds[i]), kindOrder(kinds[j])
		return a < b || a == b && kinds[i] < kinds[j]
	})
	out := make([]Settings, len(kinds))
	for i, k := range kinds {
		out[i] = drivers[k].Settings
	}
	return out
}

func kindOrder(k Kind) int {
	for i, x := range Kinds {
		if x == k {
			return i
		}
	}
	return len(Kinds)
}

// lookupScheme returns the kind that registered name (a URL scheme or a
// fake, lower-case) and its Settings. For a built-in kind that is not
// linked it returns the kind and the error naming the import; for an
// unknown name, ok is false.
func lookupScheme(name string) (sc scheme, s Settings, ok bool, err error) {
	driversMu.RLock()
	sc, ok = schemes[name]
	if ok {
		s = drivers[sc.kind].Settings
	}
	driversMu.RUnlock()
	if ok {
		return sc, s, true, nil
	}
	if k, known := builtinKinds[name]; known {
		_, err = driver(k)
		return scheme{kind: k}, s, true, err
	}
	return sc, s, false, nil
}

// schemeList lists the linked kinds' schemes (with suffix) and fakes, as
// errors name them: "kafka, amqp or mem" and "kfake, pstest".
func schemeList(suffix string) (listed, fakes string) {
	var names, fakeNames []string
	for _, s := range linkedSettings() {
		for _, n := range s.Schemes {
			names = append(names, n+suffix)
		}
		for _, f := range s.Fakes {
			fakeNames = append(fakeNames, f.Name)
		}
	}
	switch len(names) {
	case 0:
		listed = "the scheme of a linked kind (none is: add import _ \"github.com/millwright/millwright/transport/all\")"
	case 1:
		listed = names[0]
	default:
		listed = strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
	}
	return listed, strings.Join(fakeNames, ", ")
}

// fieldValue is Settings.Fields[field] of the kind that has it.
func fieldValue(c Config, field string) (string, bool) {
	driversMu.RLock()
	defer driversMu.RUnlock()
	for _, d := range drivers {
		if f, ok := d.Settings.Fields[field]; ok {
			return f(c), true
		}
	}
	return "", false
}

// describe is Settings.Describe of c's kind.
func describe(c Config) (string, bool) {
	driversMu.RLock()
	d, ok := drivers[c.Kind]
	driversMu.RUnlock()
	if !ok || d.Settings.Describe == nil {
		return "", false
	}
	return d.Settings.Describe(c), true
}

// errNoScheme is ParseURL's error for a URL without a scheme. It does not
// echo the URL: without a scheme nothing tells which part is a password
// (what stands before a later "://" may be one).
func errNoScheme() error {
	listed, _ := schemeList("://")
	return errors.New("transport: URL has no scheme (not shown: it may hold a password): want " + listed)
}
