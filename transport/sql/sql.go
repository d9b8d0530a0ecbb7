package sql

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/batch"
	"github.com/millwright/millwright/internal/closers"
	"github.com/millwright/millwright/internal/pgconn"
	"github.com/millwright/millwright/internal/redact"
	"github.com/millwright/millwright/internal/sqlschema"
	"github.com/millwright/millwright/internal/storage"
	"github.com/millwright/millwright/transport"
)

// Config is transport.SQLConfig: the settings live in package transport, so that
// a program links only the kinds it imports.
type Config = transport.SQLConfig

func setDefaults(c *Config) {
	if c.MaxOpenConns == 0 {
		c.MaxOpenConns = 10
	}
	if c.PollInterval == 0 {
		c.PollInterval = 100 * time.Millisecond
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = 10 * time.Second
	}
	if c.ResendInterval == 0 {
		c.ResendInterval = time.Second
	}
	if c.HorizonCheckInterval == 0 {
		c.HorizonCheckInterval = 10 * time.Second
	}
	if c.HorizonWarnAge == 0 {
		c.HorizonWarnAge = 30 * time.Second
	}
	if c.WakeCheckInterval == 0 {
		c.WakeCheckInterval = DefaultWakeCheckInterval
	}
}

// DefaultWakeCheckInterval is Config.WakeCheckInterval's default: a lost
// wake-up connection is found, and the rows it did not wake for are
// read, within about twice this.
const DefaultWakeCheckInterval = 5 * time.Second

// minWakeCheckInterval is the shortest WakeCheckInterval accepted.
const minWakeCheckInterval = 10 * time.Millisecond

// Validate reports configuration that cannot work, naming the field.
func validate(c Config) error {
	var errs []error
	if c.DB == nil {
		if c.URL == "" {
			errs = append(errs, errors.New("sql: URL is empty: set postgres://user:pass@host:5432/db (env MILLWRIGHT_SQL_URL)"))
		} else if u, err := url.Parse(c.URL); err != nil {
			errs = append(errs, errors.New("sql: URL is malformed (not shown: it may hold a password): want postgres://user:pass@host:5432/db"))
		} else if u.Scheme != "postgres" && u.Scheme != "postgresql" {
			errs = append(errs, fmt.Errorf("sql: URL scheme %q: want postgres", u.Scheme))
		}
	}
	if c.MaxOpenConns < 0 {
		errs = append(errs, fmt.Errorf("sql: MaxOpenConns %d is negative", c.MaxOpenConns))
	}
	if c.PollInterval < 0 {
		errs = append(errs, fmt.Errorf("sql: PollInterval %s is negative", c.PollInterval))
	}
	if c.ResendInterval < 0 {
		errs = append(errs, fmt.Errorf("sql: ResendInterval %s is negative", c.ResendInterval))
	}
	if c.HorizonCheckInterval < 0 && c.HorizonCheckInterval != -1 {
		errs = append(errs, fmt.Errorf("sql: HorizonCheckInterval %s is negative: want a duration, or -1 to disable the check", c.HorizonCheckInterval))
	}
	if c.HorizonWarnAge < 0 {
		errs = append(errs, fmt.Errorf("sql: HorizonWarnAge %s is negative", c.HorizonWarnAge))
	}
	if c.WakeCheckInterval != 0 && c.WakeCheckInterval != -1 && c.WakeCheckInterval < minWakeCheckInterval { // 0: the default
		errs = append(errs, fmt.Errorf("sql: WakeCheckInterval %s: want at least %s, or -1 to disable the wake-up connections' checks", c.WakeCheckInterval, minWakeCheckInterval))
	}
	if c.ListenURL != "" && c.ListenURL != "-" {
		if u, err := url.Parse(c.ListenURL); err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
			errs = append(errs, errors.New(`sql: ListenURL is not a postgres:// URL (not shown: it may hold a password): want postgres://user:pass@host:5432/db, or "-" to disable the wake-up`))
		}
	}
	return errors.Join(errs...)
}

// Transport is an open Postgres pool with a watermill-sql publisher.
type Transport struct {
	cfg    Config
	logger watermill.LoggerAdapter
	db     *stdsql.DB
	ownDB  bool
	pub    *wsql.Publisher
	bp     *publisher
	mon    *horizonMonitor // nil when HorizonCheckInterval is -1
	notify *notifier       // nil when the subscribers only poll
	schema raceFreeSchema  // pollOnlySchema when ListenURL is "-"

	subs closers.Set
}

// Open opens (or adopts) the pool, pings it within ConnectTimeout and
// creates the publisher. It makes one attempt: transport.Open is what
// waits for a database that is down (transport.Config.WaitForBroker). An
// error that waiting cannot fix (configuration, credentials refused, a
// database that does not exist, SSL the server does not have) is marked
// failure.Permanent. Errors name the URL as sql.Config.URL.
func Open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter) (*Transport, error) {
	return open(ctx, cfg, logger, "sql.Config.URL")
}

// open is Open naming urlFrom (transport.Config.Setting) as the URL's
// source in its errors.
func open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter, urlFrom string) (*Transport, error) {
	setDefaults(&cfg)
	if err := validate(cfg); err != nil {
		return nil, failure.Permanent(err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	db, own := cfg.DB, false
	if db == nil {
		var err error
		// Bounded connections (see internal/pgconn): a server that accepts
		// and never answers cannot hang a connect or, once ctx ends, a
		// statement.
		db, err = pgconn.Open(pgconn.WithConnectTimeout(cfg.URL, cfg.ConnectTimeout))
		if err != nil {
			return nil, failure.Permanent(fmt.Errorf("sql: opening %s (from %s): %w", redact.URL(cfg.URL), urlFrom, redact.ErrorOf(err, cfg.URL)))
		}
		db.SetMaxOpenConns(cfg.MaxOpenConns)
		db.SetMaxIdleConns(cfg.MaxOpenConns)
		own = true
	}
	if err := ping(ctx, db, cfg.ConnectTimeout); err != nil {
		if own {
			db.Close()
		}
		return nil, pingError(cfg, urlFrom, redact.ErrorOf(err, cfg.URL))
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		if own {
			db.Close()
		}
		return nil, err
	}
	sch := schema
	if cfg.ListenURL == "-" {
		sch = pollOnlySchema
	}
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: sch, AutoInitializeSchema: true}, logger)
	if err != nil {
		if own {
			db.Close()
		}
		return nil, fmt.Errorf("sql: creating publisher: %w", err)
	}
	t := &Transport{cfg: cfg, logger: logger, db: db, ownDB: own, pub: pub, schema: sch, bp: &publisher{Publisher: pub, db: db, schema: sch}}
	if cfg.HorizonCheckInterval > 0 {
		t.mon = newHorizonMonitor(db, logger, cfg.HorizonCheckInterval, cfg.HorizonWarnAge, m)
	}
	if u := listenURL(cfg); u != "" {
		t.notify = newNotifier(pgconn.WithConnectTimeout(u, cfg.ConnectTimeout), logger, max(cfg.WakeCheckInterval, 0))
	}
	return t, nil
}

// listenURL is where the wake-up LISTENs: ListenURL, else URL; "" for
// none.
func listenURL(cfg Config) string {
	switch cfg.ListenURL {
	case "-":
		return ""
	case "":
		return cfg.URL
	}
	return cfg.ListenURL
}

// ping checks the pool within timeout. A pool from Config.DB may be plain
// lib/pq, which does not watch the context while it waits for the
// server's startup reply: a server that accepts and never answers would
// hang PingContext, so the wait is bounded here too. The error says which
// happened: the ping's own error (a refusal, at once), no answer within
// timeout, or ctx ending first.
func ping(ctx context.Context, db *stdsql.DB, timeout time.Duration) error {
	start := time.Now()
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- db.PingContext(pctx) }()
	select {
	case err := <-done:
		return err
	case <-pctx.Done():
	}
	// A pool of ours returns at once with a more precise error.
	select {
	case err := <-done:
		return err
	case <-time.After(100 * time.Millisecond):
	}
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted while waiting for postgres to answer (after %s): %w", time.Since(start).Round(time.Millisecond), context.Cause(ctx))
	}
	return fmt.Errorf("postgres did not answer within %s: %w", timeout, pctx.Err())
}

// Schema is the watermill-sql schema adapter millwright uses: one table per
// topic named watermill_<topic>, payload stored as BYTEA so any payload
// (not only JSON) round-trips, with the wake-up trigger (see notify.go).
func Schema() wsql.SchemaAdapter { return schema }

var (
	schema = raceFreeSchema{DefaultPostgreSQLSchema: wsql.DefaultPostgreSQLSchema{
		GeneratePayloadType: func(string) string { return "BYTEA" },
	}}
	// pollOnlySchema creates no trigger (ListenURL "-").
	pollOnlySchema = raceFreeSchema{DefaultPostgreSQLSchema: schema.DefaultPostgreSQLSchema, noNotify: true}
)

// OffsetsAdapter is the watermill-sql offsets adapter millwright uses.
func OffsetsAdapter() wsql.OffsetsAdapter {
	return raceFreeOffsets{wsql.DefaultPostgreSQLOffsetsAdapter{}}
}

// Two sessions running CREATE TABLE IF NOT EXISTS for one new topic at
// once can both pass the existence check, and the loser fails with a
// unique violation on pg_class (or duplicate_object on the row type).
// watermill-sql runs its schema queries outside a transaction, on a pool,
// so a lock cannot be held across them; instead each argument-free query
// is wrapped in a block that, on such a conflict, runs it again (up to 10
// times): a conflict surfaces only once the other session has committed, so
// the next attempt sees its objects and IF NOT EXISTS skips the table.
// Running it again (rather than ignoring the error) matters when the
// conflict was on an implicit object of a different table: two new topics
// whose long names truncate to the same 63-byte sequence name collide on
// that sequence, and a later attempt picks a free name.
type raceFreeSchema struct {
	wsql.DefaultPostgreSQLSchema
	noNotify bool // no wake-up trigger
}

func (s raceFreeSchema) SchemaInitializingQueries(topic string) []wsql.Query {
	qs := tolerateExisting(s.DefaultPostgreSQLSchema.SchemaInitializingQueries(topic))
	if s.noNotify {
		return qs
	}
	// The wake-up trigger (see notify.go), on every table the transport
	// creates or subscribes to.
	for _, q := range storage.SQLNotifySchemaStatements(s.MessagesTable(topic)) {
		qs = append(qs, wsql.Query{Query: q})
	}
	return qs
}

type raceFreeOffsets struct {
	wsql.DefaultPostgreSQLOffsetsAdapter
}

func (a raceFreeOffsets) SchemaInitializingQueries(topic string) []wsql.Query {
	return tolerateExisting(a.DefaultPostgreSQLOffsetsAdapter.SchemaInitializingQueries(topic))
}

func tolerateExisting(qs []wsql.Query) []wsql.Query {
	out := make([]wsql.Query, len(qs))
	for i, q := range qs {
		if len(q.Args) > 0 {
			out[i] = q
			continue
		}
		out[i] = wsql.Query{Query: storage.TolerateExisting(q.Query)}
	}
	return out
}

// DB returns the transport's pool.
func (t *Transport) DB() *stdsql.DB { return t.db }

// Publisher returns the transport's publisher, safe for concurrent use. It
// has PublishBatch (transport.BatchPublisher), PrepareTopic and Table
// (transport.InDatabasePublisher).
func (t *Transport) Publisher() message.Publisher { return t.bp }

// publisher adds PublishBatch, PrepareTopic and Table to
// watermill-sql's publisher.
type publisher struct {
	*wsql.Publisher
	db     *stdsql.DB
	schema raceFreeSchema

	mu     sync.Mutex
	tables map[string]string // topic -> its table, schema-qualified
}

// PublishBatch inserts msgs with one INSERT statement, committed on its own:
// all or none are published, in the order given (watermill-sql's offsets
// follow the VALUES order), so every ordering key keeps its order. It is
// Publish with many messages: watermill-sql already inserts them at once;
// having the method tells the outbox relay to send a whole batch in one
// call (one commit, one WAL flush) rather than split it over
// PublishConcurrency calls and commits.
func (p *publisher) PublishBatch(topic string, msgs ...*message.Message) error {
	return p.Publish(topic, msgs...)
}

// DB is the database the publisher writes to.
func (p *publisher) DB() *stdsql.DB { return p.db }

// PrepareTopic creates topic's table if needed, on the publisher's pool, as
// Publish does, and finds its schema, once per topic.
func (p *publisher) PrepareTopic(ctx context.Context, topic string) error {
	_, err := p.table(ctx, topic)
	return err
}

// Table returns a prepared topic's table, named with its schema so that
// it means the same table on any connection to this database.
func (p *publisher) Table(topic string) (string, error) {
	p.mu.Lock()
	table, ok := p.tables[topic]
	p.mu.Unlock()
	if !ok {
		return "", fmt.Errorf("sql: topic %q: Table before PrepareTopic", topic)
	}
	return table, nil
}

var (
	_ batch.Publisher     = (*publisher)(nil)
	_ sqlschema.Publisher = (*publisher)(nil)
)

// table creates topic's table if needed and returns its schema-qualified
// name, once per topic.
func (p *publisher) table(ctx context.Context, topic string) (string, error) {
	p.mu.Lock()
	name, ok := p.tables[topic]
	p.mu.Unlock()
	if ok {
		return name, nil
	}
	if disallowedTopic.MatchString(topic) {
		return "", fmt.Errorf("sql: topic %q: %w", topic, wsql.ErrInvalidTopicName)
	}
	// The schema adapter's statements (watermill-sql's, wrapped by
	// tolerateExisting), run as watermill-sql runs them.
	for _, q := range p.schema.SchemaInitializingQueries(topic) {
		if _, err := p.db.ExecContext(ctx, q.Query, q.Args...); err != nil {
			return "", fmt.Errorf("sql: creating the table of topic %q: %w", topic, err)
		}
	}
	name, err := storage.QualifiedTableName(ctx, storage.NewSQL(p.db), schema.MessagesTable(topic))
	if err != nil {
		return "", fmt.Errorf("sql: finding the table of topic %q: %w", topic, err)
	}
	p.mu.Lock()
	if p.tables == nil {
		p.tables = map[string]string{}
	}
	p.tables[topic] = name
	p.mu.Unlock()
	return name, nil
}

// disallowedTopic is watermill-sql's rule for topic names (they become
// table names).
var disallowedTopic = regexp.MustCompile(`[^A-Za-z0-9\-\$\:\.\_]`)

// Subscriber returns a subscriber in consumer group `group` (its own offset
// per topic). Group "" is watermill-sql's default group. It is also a
// message.SubscribeInitializer. The first Subscribe starts the horizon
// check (Config.HorizonCheckInterval).
func (t *Transport) Subscriber(group string) (message.Subscriber, error) {
	sub, err := closers.Add(&t.subs, "sql", func() (*subscriber, error) {
		sub, err := wsql.NewSubscriber(t.db, t.subscriberConfig(group, nil), t.logger)
		if err != nil {
			return nil, fmt.Errorf("sql: creating subscriber for group %q: %w", group, err)
		}
		s := newSubscriber(sub, t.mon)
		if t.notify != nil {
			t.notify.start()
			s.woken = func(ctx context.Context, topic string) (upstreamSubscriber, func(), error) {
				return t.wokenSubscriber(ctx, s, group, topic)
			}
		}
		return s, nil
	})
	if err != nil {
		return nil, err // not a typed nil in the interface
	}
	return sub, nil
}

// wokenSubscriber is a watermill-sql subscriber of its own for one
// Subscribe of topic, whose BackoffManager waits for the topic table's
// notifications (see notify.go); the returned function stops them. It
// creates the table first (the trigger comes with it) to know its oid, and
// waits up to ConnectTimeout for the LISTEN to be in effect, so that a
// message committed after Subscribe returns wakes it; past that it logs
// and polls until the listener connects.
func (t *Transport) wokenSubscriber(ctx context.Context, s *subscriber, group, topic string) (upstreamSubscriber, func(), error) {
	if err := s.SubscribeInitialize(topic); err != nil {
		return nil, nil, err
	}
	oid, err := storage.TableOID(ctx, storage.NewSQL(t.db), schema.MessagesTable(topic))
	if err != nil {
		return nil, nil, fmt.Errorf("sql: finding the table of topic %q: %w", topic, err)
	}
	if !t.notify.waitReady(t.cfg.ConnectTimeout) {
		t.logger.Info("sql: the wake-up LISTEN is not in effect yet; the subscriber polls every PollInterval until it is",
			watermill.LogFields{"topic": topic, "poll_interval": t.cfg.PollInterval.String()})
	}
	w, unregister := t.notify.register(oid, schema.MessagesTable(topic))
	bm := &wakeBackoff{n: t.notify, w: w, def: wsql.NewDefaultBackoffManager(t.cfg.PollInterval, 0), poll: t.cfg.PollInterval,
		ctx: ctx, close: s.closing, xmin: func(ctx context.Context) (uint64, error) {
			qctx, cancel := context.WithTimeout(ctx, t.cfg.ConnectTimeout)
			defer cancel()
			return storage.SnapshotXmin(qctx, storage.NewSQL(t.db))
		}}
	offsets := raceFreeOffsets{}.MessagesOffsetsTable(topic)
	bm.look = func(ctx context.Context) (storage.SQLWakeLook, error) {
		return t.notify.locks.look(ctx, storage.NewSQL(t.db), w, offsets, group)
	}
	sub, err := wsql.NewSubscriber(t.db, t.subscriberConfig(group, bm), t.logger)
	if err != nil {
		unregister()
		return nil, nil, fmt.Errorf("sql: creating subscriber for group %q: %w", group, err)
	}
	return sub, unregister, nil
}

func (t *Transport) subscriberConfig(group string, bm wsql.BackoffManager) wsql.SubscriberConfig {
	return wsql.SubscriberConfig{
		ConsumerGroup:    group,
		PollInterval:     t.cfg.PollInterval,
		ResendInterval:   t.cfg.ResendInterval,
		BackoffManager:   bm,
		SchemaAdapter:    t.schema,
		OffsetsAdapter:   OffsetsAdapter(),
		InitializeSchema: true,
	}
}

// Close stops the horizon check, closes the subscribers, the wake-up
// listener, the publisher and the pool it opened. It is idempotent.
func (t *Transport) Close() error {
	if t.mon != nil {
		t.mon.stop()
	}
	return t.subs.Close(t.pub.Close, func() error {
		if t.notify != nil {
			t.notify.stop()
		}
		if t.ownDB {
			return t.db.Close()
		}
		return nil
	})
}
