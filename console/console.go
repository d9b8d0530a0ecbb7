package console

import (
	"context"
	"crypto/rand"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"path"
	"slices"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/transport/lag"
)

//go:embed templates/*.html
var templateFiles embed.FS

//go:embed static
var staticFiles embed.FS

// Config configures a Handler.
type Config struct {
	// Authenticate identifies the operator of a request: it returns the
	// name recorded in the audit table, or ok false after writing the
	// response itself (a 401 with WWW-Authenticate, a redirect to the
	// host's login page). Required: the console has no anonymous mode. A
	// host whose own middleware authenticates puts the name in the
	// request's context with WithActor and passes ContextActor. Must be
	// safe for concurrent use.
	Authenticate func(w http.ResponseWriter, r *http.Request) (actor string, ok bool)
	// Identify is Authenticate with the operator's role: it returns the
	// operator's name and Role, or ok false after writing the response
	// itself. Set Identify or Authenticate, not both (ContextIdentity
	// reads WithActor and WithRole). Must be safe for concurrent use.
	Identify func(w http.ResponseWriter, r *http.Request) (id Identity, ok bool)
	// DefaultRole is the role of an operator the hook gives none
	// (Authenticate, which has no role, unless the host's middleware
	// called WithRole; an Identity with an empty Role). Default
	// RoleAdmin, so that a host that set Authenticate before roles
	// existed keeps every action; set RoleViewer to make every action
	// something the hook grants.
	DefaultRole Role
	// NeverEdit lists topics whose dead letters are never edited, by any
	// role (replayed unchanged only): path.Match patterns, e.g.
	// "payments.*". Default nil: every topic is editable by admins.
	NeverEdit []string
	// BasePath is the path the handler is mounted at, e.g. "/console"
	// (links and the CSRF cookie are under it); the handler strips it.
	// Default "": the root.
	BasePath string
	// Schemas are the schemas offered, in this order (the first is the
	// default). Default nil: the pool's current schema only (the first
	// of its search_path). A name given here is offered only while the
	// database has millwright tables in it. The console never lists the
	// database's other schemas (another team's data) unless AllSchemas.
	Schemas []string
	// AllSchemas offers every schema of the database that holds a
	// millwright table, Schemas or not. Default false.
	AllSchemas bool
	// SagaDiagrams maps a saga type to its Mermaid diagram
	// (saga.Definition.Mermaid()), shown on the type's sagas. Default
	// nil: no diagrams.
	SagaDiagrams map[string]string
	// Lag reads consumer lag for the Consumer lag page (lag.go): a
	// transport's lag reader (kafka.NewLagReader, amqp.NewLagReader) or
	// several joined (lag.Readers). Default nil: the page says how to
	// configure it.
	Lag lag.Reader
	// CSRFKey signs the CSRF tokens. Default nil: 32 random bytes, so
	// that tokens last as long as the process; several replicas behind
	// one address need a shared key of at least 32 bytes.
	CSRFKey []byte
	// Logger logs failed requests. Default watermill.NopLogger.
	Logger watermill.LoggerAdapter
	// RequestTimeout bounds each request's database work. Default 30s;
	// must be >= 0.
	RequestTimeout time.Duration
	// now is the clock, for tests.
	now func() time.Time
}

func (c *Config) setDefaults() error {
	c.BasePath = strings.TrimRight(c.BasePath, "/")
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = 30 * time.Second
	}
	if c.CSRFKey == nil {
		c.CSRFKey = make([]byte, 32)
		if _, err := rand.Read(c.CSRFKey); err != nil {
			return fmt.Errorf("console: generating the CSRF key: %w", err)
		}
	}
	if c.now == nil {
		c.now = time.Now
	}
	if c.DefaultRole == "" {
		c.DefaultRole = RoleAdmin
	}
	return nil
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if c.Authenticate == nil && c.Identify == nil {
		return errors.New("console: Config.Authenticate is nil: pass the host's authentication (or ContextActor behind the host's auth middleware; Config.Identify to give roles too); the console has no anonymous mode")
	}
	if c.Authenticate != nil && c.Identify != nil {
		return errors.New("console: Config.Authenticate and Config.Identify are both set: pass one (Identify returns the role too)")
	}
	if err := c.DefaultRole.Valid(); err != nil {
		return fmt.Errorf("%w (Config.DefaultRole)", err)
	}
	for _, p := range c.NeverEdit {
		if _, err := path.Match(p, ""); err != nil || p == "" {
			return fmt.Errorf("console: Config.NeverEdit %q: want a topic or a path.Match pattern such as payments.*", p)
		}
	}
	if c.BasePath != "" && !strings.HasPrefix(c.BasePath, "/") {
		return fmt.Errorf("console: Config.BasePath %q: want a path starting with /, e.g. /console", c.BasePath)
	}
	if len(c.CSRFKey) < 32 {
		return fmt.Errorf("console: Config.CSRFKey has %d bytes: want at least 32 (or nil for a random key)", len(c.CSRFKey))
	}
	if c.RequestTimeout < 0 {
		return fmt.Errorf("console: Config.RequestTimeout %v: want >= 0", c.RequestTimeout)
	}
	for _, s := range c.Schemas {
		if s == "" {
			return errors.New("console: Config.Schemas has an empty name")
		}
	}
	return nil
}

// Handler is the console, an http.Handler. It is safe for concurrent use.
type Handler struct {
	db   postgres.DB
	cfg  Config
	mux  *http.ServeMux
	tmpl *template.Template
	// patterns are the routes registered by page, for Routes.
	patterns []string
}

// New returns the console on db, a *sql.DB or *pgxpool.Pool of the
// database holding millwright's tables.
func New(db postgres.DB, cfg Config) (*Handler, error) {
	if err := db.Valid(); err != nil {
		return nil, fmt.Errorf("console: New: db is nil: pass postgres.From(pool) of an open *sql.DB or *pgxpool.Pool: %w", err)
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tmpl, err := template.New("").Funcs(funcs).ParseFS(templateFiles, "templates/*.html")
	if err != nil {
		return nil, fmt.Errorf("console: parsing templates: %w", err)
	}
	h := &Handler{db: db, cfg: cfg, tmpl: tmpl, mux: http.NewServeMux()}
	h.routes()
	return h, nil
}

func (h *Handler) routes() {
	static, _ := fs.Sub(staticFiles, "static")
	h.mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServer(http.FS(static))))
	h.mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, h.cfg.BasePath+"/dead-letters?"+r.URL.RawQuery, http.StatusSeeOther)
	})
	h.page("GET /dead-letters", h.deadLetters)
	h.page("GET /dead-letters/{id}", h.deadLetter)
	h.page("GET /dead-letters/{id}/edit", h.editForm)
	h.page("POST /dead-letters/{id}/edit", h.edit)
	h.page("POST /dead-letters/replay", h.replay)
	h.page("GET /sagas", h.sagas)
	h.page("GET /sagas/{id}", h.sagaPage)
	h.page("POST /sagas/{id}/resolve", h.resolve)
	h.page("GET /outbox", h.outbox)
	h.page("POST /outbox/retry-failed", h.retryFailed)
	h.page("GET /audit", h.auditPage)
	h.page("GET /lag", h.lagPage) // lag.go
	// Parked keys (parked.go).
	h.page("GET /parked", h.parked)
	h.page("GET /parked/key", h.parkedKey)
	h.page("POST /parked/action", h.parkedAction)
	h.bulkRoutes() // bulk.go
}

// ServeHTTP serves the console: security headers on every answer, then
// authentication, then (for POST) the CSRF checks, then the page.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	setSecurityHeaders(w.Header())
	path := r.URL.Path
	if h.cfg.BasePath != "" {
		rest, ok := strings.CutPrefix(path, h.cfg.BasePath)
		if !ok || (rest != "" && !strings.HasPrefix(rest, "/")) {
			http.NotFound(w, r)
			return
		}
		if rest == "" {
			rest = "/"
		}
		r2 := new(http.Request)
		*r2 = *r
		u := *r.URL
		u.Path, u.RawPath = rest, ""
		r2.URL = &u
		r = r2
	}
	if strings.HasPrefix(r.URL.Path, "/static/") {
		h.mux.ServeHTTP(w, r)
		return
	}
	id, ok := h.identify(w, r)
	if !ok {
		return
	}
	if strings.TrimSpace(id.Name) == "" {
		http.Error(w, "console: the authentication hook returned an empty operator name", http.StatusInternalServerError)
		return
	}
	if err := id.Role.Valid(); err != nil {
		h.fail(w, r, http.StatusInternalServerError, fmt.Errorf("the authentication hook returned operator %q with an invalid role: %w", id.Name, err))
		return
	}
	r = r.WithContext(WithRole(context.WithValue(r.Context(), actorKey{}, id.Name), id.Role))
	// The role is checked on the server for every route, before anything
	// else: a page that hid the button is not the defence.
	if err := h.checkRole(r); err != nil {
		h.fail(w, r, http.StatusForbidden, err)
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		if err := h.checkPost(w, r); err != nil {
			h.fail(w, r, http.StatusForbidden, err)
			return
		}
	}
	h.mux.ServeHTTP(w, r)
}

// req is what a page handler gets: the request, its operator and schema.
type req struct {
	*http.Request
	w       http.ResponseWriter
	actor   string
	role    Role
	schema  string
	schemas []string
}

// pageFunc renders a page or returns an error for h.fail.
type pageFunc func(ctx context.Context, q *req) error

// httpError is an error with a status for the operator.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func badRequest(format string, args ...any) error {
	return &httpError{status: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

func notFound(format string, args ...any) error {
	return &httpError{status: http.StatusNotFound, msg: fmt.Sprintf(format, args...)}
}

func (h *Handler) page(pattern string, f pageFunc) {
	h.patterns = append(h.patterns, pattern)
	h.mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		if h.cfg.RequestTimeout > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, h.cfg.RequestTimeout)
			defer cancel()
		}
		if r.Method == http.MethodPost {
			r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
			if err := r.ParseForm(); err != nil {
				h.fail(w, r, http.StatusBadRequest, fmt.Errorf("reading the form: %w", err))
				return
			}
		}
		q := &req{Request: r, w: w, actor: actorOf(r), role: roleOf(r)}
		schema, schemas, err := h.selectSchema(ctx, r.FormValue("schema"))
		if err == nil {
			q.schema, q.schemas = schema, schemas
			err = f(ctx, q)
		}
		if err != nil {
			status := http.StatusInternalServerError
			var he *httpError
			if errors.As(err, &he) {
				status = he.status
			}
			h.fail(w, r, status, err)
		}
	})
}

// maxFormBytes bounds a POST body: an edited payload and its fields.
const maxFormBytes = 4 << 20

// selectSchema validates the requested schema against those holding
// millwright tables (and Config.Schemas); "" picks the default: the
// first of Config.Schemas, else the pool's current schema, else the first.
func (h *Handler) selectSchema(ctx context.Context, want string) (string, []string, error) {
	found, err := migrate.Schemas(ctx, h.db)
	if err != nil {
		return "", nil, err
	}
	found, err = h.scope(ctx, found)
	if err != nil {
		return "", nil, err
	}
	if len(found) == 0 {
		return "", nil, &httpError{status: http.StatusServiceUnavailable,
			msg: "no schema the console is configured with holds millwright tables: run `millwright migrate`, or name the schemas (Config.Schemas, `millwright console --schema`; Config.AllSchemas, --all-schemas, for every schema of the database)"}
	}
	if want != "" {
		if !slices.Contains(found, want) {
			return "", nil, badRequest("unknown schema %q: want one of %s", want, strings.Join(found, ", "))
		}
		return want, found, nil
	}
	if current, err := migrate.CurrentSchema(ctx, h.db); h.cfg.Schemas == nil && err == nil && slices.Contains(found, current) {
		return current, found, nil
	}
	return found[0], found, nil
}

// write runs f in a transaction whose search_path is the request's
// schema, committed when f returns nil.
func (h *Handler) write(ctx context.Context, q *req, f func(tx postgres.Tx) error) error {
	return migrate.InSchema(ctx, h.db, q.schema, false, f)
}

// read runs f in a read-only transaction in the request's schema.
func (h *Handler) read(ctx context.Context, q *req, f func(tx postgres.Tx) error) error {
	return migrate.InSchema(ctx, h.db, q.schema, true, f)
}

// fail answers err: the operator sees the message with secrets masked;
// the log gets it too.
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, status int, err error) {
	msg := dlq.Redacted(err.Error())
	if status >= 500 {
		h.cfg.Logger.Error("console: request failed", errors.New(msg), watermill.LogFields{"path": r.URL.Path, "method": r.Method})
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_ = h.tmpl.ExecuteTemplate(w, "error.html", &view{Title: http.StatusText(status), Base: h.cfg.BasePath, Error: msg, Status: status, Actor: actorOf(r)})
}
