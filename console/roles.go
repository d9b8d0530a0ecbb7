package console

import (
	"context"
	"fmt"
	"net/http"
	"path"
	"slices"
	"strings"

	"github.com/millwright/millwright/migrate"
)

// Role is what an operator may do in the console. Each role may do what
// the roles before it may:
//
//   - RoleViewer reads every page and changes nothing.
//   - RoleOperator also replays dead letters (one, a selection, or in bulk
//     over a filter) and retries failed outbox rows: actions that resend
//     what was already sent once, unchanged.
//   - RoleAdmin also edits and replays, discards (archives) dead letters,
//     and resolves stuck sagas: actions that change what is sent, or
//     give up on it.
//
// The console refuses an action on the server (403, naming the role it
// needs) whatever the page showed; the pages also hide what the role
// cannot do.
type Role string

// The roles, least first.
const (
	RoleViewer   Role = "viewer"
	RoleOperator Role = "operator"
	RoleAdmin    Role = "admin"
)

// Roles lists the roles, least first.
var Roles = []Role{RoleViewer, RoleOperator, RoleAdmin}

func (r Role) rank() int { return slices.Index(Roles, r) }

// Allows reports whether r may do what need may.
func (r Role) Allows(need Role) bool { return r.rank() >= 0 && r.rank() >= need.rank() }

// Valid reports a role that is not one of Roles.
func (r Role) Valid() error {
	if r.rank() < 0 {
		return fmt.Errorf("console: role %q: want one of viewer, operator, admin", string(r))
	}
	return nil
}

// ParseRole reads a role's name (any case).
func ParseRole(s string) (Role, error) {
	r := Role(strings.ToLower(strings.TrimSpace(s)))
	return r, r.Valid()
}

// Identity is who makes a request: the operator's name (recorded in the
// audit table) and role.
type Identity struct {
	Name string
	Role Role
}

type roleKey struct{}

// WithRole returns ctx carrying the operator's role, for ContextActor and
// ContextIdentity: a host's authentication middleware calls it beside
// WithActor. Without it the operator has Config.DefaultRole.
func WithRole(ctx context.Context, role Role) context.Context {
	return context.WithValue(ctx, roleKey{}, role)
}

// ContextIdentity is a Config.Identify for hosts that authenticate in
// their own middleware: the name WithActor and the role WithRole put in
// the request's context (Config.DefaultRole when no role was put), or a
// 401 when there is no name.
func ContextIdentity(w http.ResponseWriter, r *http.Request) (Identity, bool) {
	name, ok := ContextActor(w, r)
	if !ok {
		return Identity{}, false
	}
	role, _ := r.Context().Value(roleKey{}).(Role)
	return Identity{Name: name, Role: role}, true
}

func roleOf(r *http.Request) Role {
	role, _ := r.Context().Value(roleKey{}).(Role)
	return role
}

// routeRoles is the role each route needs beyond RoleViewer. A GET not
// listed needs RoleViewer; any other method not listed needs RoleAdmin:
// an action added without a line here is refused to all but admins, never
// allowed to a viewer.
var routeRoles = map[string]Role{
	"POST /dead-letters/replay":    RoleOperator,
	"POST /outbox/retry-failed":    RoleOperator,
	"GET /dead-letters/{id}/edit":  RoleAdmin,
	"POST /dead-letters/{id}/edit": RoleAdmin,
	"POST /sagas/{id}/resolve":     RoleAdmin,
	// Bulk actions: each route needs the role of its action.
	"POST /dead-letters/bulk/replay":  RoleOperator,
	"POST /dead-letters/bulk/discard": RoleAdmin,
	"POST /bulk/{id}/resume":          RoleOperator, // and the job's own action's role (bulk.go)
	// Parked keys: retry and release need an operator, skip an admin
	// (parkedNeed, parked.go).
	"POST /parked/action": RoleOperator,
}

// Route is one route of the console and the role it needs.
type Route struct {
	// Pattern is the http.ServeMux pattern, e.g. "POST /dead-letters/replay".
	Pattern string
	// Role is the least role allowed.
	Role Role
}

// Routes lists the console's routes and the role each needs, in the order
// they were registered: what a host documents for its operators, and what
// the tests walk so that no action escapes the role check.
func (h *Handler) Routes() []Route {
	out := make([]Route, 0, len(h.patterns))
	for _, p := range h.patterns {
		out = append(out, Route{Pattern: p, Role: needOf(p)})
	}
	return out
}

// needOf is the role pattern needs (see routeRoles).
func needOf(pattern string) Role {
	if r, ok := routeRoles[pattern]; ok {
		return r
	}
	if strings.HasPrefix(pattern, "GET ") || strings.HasPrefix(pattern, "HEAD ") {
		return RoleViewer
	}
	return RoleAdmin
}

// identify runs the host's hook: Config.Identify, else Config.Authenticate
// with the role WithRole put in the context. A missing role is
// Config.DefaultRole.
func (h *Handler) identify(w http.ResponseWriter, r *http.Request) (Identity, bool) {
	var id Identity
	if h.cfg.Identify != nil {
		var ok bool
		if id, ok = h.cfg.Identify(w, r); !ok {
			return id, false
		}
	} else {
		name, ok := h.cfg.Authenticate(w, r)
		if !ok {
			return id, false
		}
		id = Identity{Name: name, Role: roleOf(r)}
	}
	if id.Role == "" {
		id.Role = h.cfg.DefaultRole
	}
	return id, true
}

// checkRole refuses a request whose route needs more than the operator's
// role: the answer names the role needed, the operator's, and the fix.
func (h *Handler) checkRole(r *http.Request) error {
	_, pattern := h.mux.Handler(r)
	if pattern == "" {
		return nil // the mux answers 404 or 405
	}
	need, have := needOf(pattern), roleOf(r)
	if have.Allows(need) {
		return nil
	}
	return &httpError{status: http.StatusForbidden, msg: fmt.Sprintf(
		"refused: %s needs the %s role; %s is %s (the host's authentication gives the role: Config.Identify, or `millwright console` --token/--basic-auth-file)",
		strings.TrimPrefix(strings.TrimPrefix(pattern, "POST "), "GET "), need, actorOf(r), article(have))}
}

func article(r Role) string {
	if r == RoleAdmin || r == RoleOperator {
		return "an " + string(r)
	}
	return "a " + string(r)
}

// editable refuses an edit of a dead letter of topic when Config.NeverEdit
// names the topic: for every role, admins included.
func (h *Handler) editable(topic string) error {
	for _, p := range h.cfg.NeverEdit {
		if ok, _ := path.Match(p, topic); ok {
			return &httpError{status: http.StatusForbidden, msg: fmt.Sprintf(
				"refused: topic %q is never editable (Config.NeverEdit %q, `millwright console --never-edit`): replay it unchanged, or fix the consumer", topic, p)}
		}
	}
	return nil
}

// Can reports whether the page's operator has role need: the templates
// hide what the role cannot do.
func (v *view) Can(need string) bool { return v.Role.Allows(Role(need)) }

// CanEdit reports whether the page's operator may edit a dead letter of
// topic: an admin, and the topic not in Config.NeverEdit.
func (v *view) CanEdit(topic string) bool {
	return v.Role.Allows(RoleAdmin) && v.neverEdit(topic) == nil
}

// scope keeps the schemas the console is configured with, of found (the
// schemas holding millwright tables): every one with Config.AllSchemas,
// else Config.Schemas in their order, else the pool's current schema.
func (h *Handler) scope(ctx context.Context, found []string) ([]string, error) {
	switch {
	case h.cfg.AllSchemas:
		return found, nil
	case h.cfg.Schemas != nil:
		var out []string
		for _, s := range h.cfg.Schemas {
			if slices.Contains(found, s) && !slices.Contains(out, s) {
				out = append(out, s)
			}
		}
		return out, nil
	}
	current, err := migrate.CurrentSchema(ctx, h.db)
	if err != nil {
		return nil, fmt.Errorf("reading the pool's current schema (the console's default scope; set Config.Schemas): %w", err)
	}
	if slices.Contains(found, current) {
		return []string{current}, nil
	}
	return nil, nil
}
