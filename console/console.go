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
	// BasePath is the path the handler is mounted at, e.g. "/console"
	// (links and the CSRF cookie are under it); the handler strips it.
	// Default "": the root.
	BasePath string
	// Schemas limits the schemas offered to these names. Default nil:
	// every schema of the database that holds a millwright table. A name
	// given here is offered only while the database has such a table in
	// it.
	Schemas []string
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
	return nil
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if c.Authenticate == nil {
		return errors.New("console: Config.Authenticate is nil: pass the host's authentication (or ContextActor behind the host's auth middleware); the console has no anonymous mode")
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
	actor, ok := h.cfg.Authenticate(w, r)
	if !ok {
		return
	}
	if strings.TrimSpace(actor) == "" {
		http.Error(w, "console: the authentication hook returned an empty operator name", http.StatusInternalServerError)
		return
	}
	r = r.WithContext(context.WithValue(r.Context(), actorKey{}, actor))
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
		q := &req{Request: r, w: w, actor: actorOf(r)}
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
	if h.cfg.Schemas != nil {
		found = slices.DeleteFunc(found, func(s string) bool { return !slices.Contains(h.cfg.Schemas, s) })
	}
	if len(found) == 0 {
		return "", nil, &httpError{status: http.StatusServiceUnavailable,
			msg: "no schema of this database holds millwright tables (run `millwright migrate`), or none of Config.Schemas does"}
	}
	if want != "" {
		if !slices.Contains(found, want) {
			return "", nil, badRequest("unknown schema %q: want one of %s", want, strings.Join(found, ", "))
		}
		return want, found, nil
	}
	if h.cfg.Schemas != nil {
		for _, s := range h.cfg.Schemas {
			if slices.Contains(found, s) {
				return s, found, nil
			}
		}
	}
	if current, err := migrate.CurrentSchema(ctx, h.db); err == nil && slices.Contains(found, current) {
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
