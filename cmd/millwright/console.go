package main

import (
	"bufio"
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/spf13/cobra"
	"golang.org/x/crypto/bcrypt"

	"github.com/millwright/millwright/audit"
	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/internal/redact"
)

func init() { rootCmd.AddCommand(consoleCmd()) }

// envConsoleToken is --token's environment variable (a flag's value shows
// in ps).
const envConsoleToken = "MILLWRIGHT_CONSOLE_TOKEN"

const defaultConsoleListen = "127.0.0.1:8089"

// consoleReady, set by tests, receives the console's address once it
// listens.
var consoleReady chan<- string

func consoleCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "console",
		Short: "Serve the operator console (dead letters, sagas, outbox, audit) in the browser",
		Long: `Serve the operator console: dead letters grouped by topic and error type,
inspected, replayed or edited and replayed; sagas and their timelines;
the outbox backlog, relays and lanes; the audit table. The database is the
one every command uses (--database-url, $MILLWRIGHT_DATABASE_URL, --driver,
--schema as for ` + "`millwright relay`" + `); the schema selector offers every schema
of that database holding millwright tables.

Replays and edited replays are queued through the outbox: a relay
(` + "`millwright relay`" + `) publishes them.

It listens on ` + defaultConsoleListen + ` by default. Authentication: --token (or
$` + envConsoleToken + `) accepts "Authorization: Bearer TOKEN", or, from a
browser, basic auth with any user name (recorded in the audit table) and
the token as password; --basic-auth-file takes lines "user:bcrypt-hash"
(htpasswd -nbB user password). Without either, only a loopback address is
accepted, requests must name a loopback host (no DNS rebinding), and
actions are recorded as the OS user running the console.

Roles: viewer (reads only), operator (also replays dead letters, one, a
selection or in bulk, and retries failed outbox rows), admin (also edits
and replays, discards dead letters, resolves stuck sagas). --token takes a
comma-separated list of ROLE:TOKEN entries (a bare TOKEN is admin):
  --token viewer:s3cr3t-v,operator:s3cr3t-o,admin:s3cr3t-a
and --basic-auth-file lines take the role as a third field (none: admin):
  erin:$2y$05$...:operator
A refused action answers 403 naming the role it needs. --never-edit
PATTERN (repeatable, path.Match syntax: payments.*) makes a topic's dead
letters never editable, by any role.

Schemas: the console shows --schema ($` + envSchema + `, else the database
URL's search_path) only; --all-schemas offers every schema of the
database holding millwright tables.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runConsole(cmd, consoleReady)
		},
	}
	f := cmd.Flags()
	f.String("listen", defaultConsoleListen, "address to listen on, host:port; a non-loopback address needs --token or --basic-auth-file")
	f.String("token", "", "bearer token required of every request (default $"+envConsoleToken+")")
	f.String("basic-auth-file", "", "file of user:bcrypt-hash lines (htpasswd -nbB); the user name is recorded in the audit table")
	f.String("base-path", "", "path prefix to serve under, e.g. /console, behind a reverse proxy")
	f.StringArray("never-edit", nil, "topic (or path.Match pattern, e.g. payments.*) whose dead letters no role may edit; repeatable")
	f.Bool("all-schemas", false, "offer every schema of the database holding millwright tables (default: only --schema)")
	addDatabaseFlag(cmd)
	return cmd
}

// runConsole serves until the command's context ends; ready, if set,
// receives the address once it listens.
func runConsole(cmd *cobra.Command, ready chan<- string) error {
	fl := cmd.Flags()
	listen, _ := fl.GetString("listen")
	token, _ := fl.GetString("token")
	if !fl.Changed("token") {
		token = os.Getenv(envConsoleToken)
	}
	authFile, _ := fl.GetString("basic-auth-file")
	basePath, _ := fl.GetString("base-path")
	auth, how, err := consoleAuth(listen, token, authFile)
	if err != nil {
		return fmt.Errorf("millwright console: %w", err)
	}
	pool, err := openPool(cmd)
	if err != nil {
		return err
	}
	defer pool.Close()
	neverEdit, _ := fl.GetStringArray("never-edit")
	allSchemas, _ := fl.GetBool("all-schemas")
	schema, err := schemaOf(cmd)
	if err != nil {
		return err
	}
	cfg := console.Config{Identify: auth, BasePath: basePath, NeverEdit: neverEdit, AllSchemas: allSchemas,
		Logger: redact.Logger(watermill.NewStdLoggerWithOut(cmd.ErrOrStderr(), false, false))}
	if schema != "" {
		cfg.Schemas = []string{schema}
	}
	h, err := console.New(pool.handle(), cfg)
	if err != nil {
		return fmt.Errorf("millwright console: %w", err)
	}
	var handler http.Handler = h
	if strings.HasPrefix(how, "none") {
		handler = loopbackHostOnly(h)
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("millwright console: --listen %s: %w", listen, err)
	}
	srv := newHTTPServer(handler, defaultHTTPTimeouts)
	fmt.Fprintf(cmd.ErrOrStderr(), "millwright console: http://%s%s/ (authentication: %s)\n", ln.Addr(), basePath, how)
	if ready != nil {
		ready <- ln.Addr().String()
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		return fmt.Errorf("millwright console: serving: %w", err)
	case <-cmd.Context().Done():
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(cmd.Context()), 5*time.Second)
	defer cancel()
	return srv.Shutdown(ctx)
}

// consoleAuth returns the authentication of --token or --basic-auth-file,
// or none on a loopback address (the OS user acts).
func consoleAuth(listen, token, authFile string) (identify, string, error) {
	switch {
	case token != "" && authFile != "":
		return nil, "", errors.New("--token and --basic-auth-file: pass one of them")
	case token != "":
		tokens, err := parseTokens(token)
		if err != nil {
			return nil, "", err
		}
		how := "token"
		if len(tokens) > 1 {
			how = fmt.Sprintf("%d tokens", len(tokens))
		}
		return tokenAuth(tokens), how, nil
	case authFile != "":
		users, err := readBasicAuthFile(authFile)
		if err != nil {
			return nil, "", err
		}
		return basicAuthOf(users), "basic (" + authFile + ")", nil
	}
	if !isLoopback(listen) {
		return nil, "", fmt.Errorf("--listen %s is not a loopback address, and the console changes data: pass --token (or $%s) or --basic-auth-file, or listen on 127.0.0.1", listen, envConsoleToken)
	}
	user := audit.CurrentUser()
	return func(http.ResponseWriter, *http.Request) (console.Identity, bool) {
		return console.Identity{Name: user, Role: console.RoleAdmin}, true
	}, "none (loopback only; actions recorded as " + user + ", an admin)", nil
}

// identify is a console.Config.Identify.
type identify = func(http.ResponseWriter, *http.Request) (console.Identity, bool)

// consoleToken is one --token entry: the token and its role.
type consoleToken struct {
	token []byte
	role  console.Role
	// named: the entry gave its role (the bearer operator is named by it).
	named bool
}

// parseTokens reads --token: comma-separated TOKEN or ROLE:TOKEN entries;
// a bare TOKEN is an admin (as before roles).
func parseTokens(list string) ([]consoleToken, error) {
	var out []consoleToken
	for i, e := range strings.Split(list, ",") {
		e = strings.TrimSpace(e)
		if e == "" {
			return nil, fmt.Errorf("--token entry %d is empty: want TOKEN or ROLE:TOKEN entries separated by commas", i+1)
		}
		t := consoleToken{token: []byte(e), role: console.RoleAdmin}
		if prefix, rest, ok := strings.Cut(e, ":"); ok {
			if role, err := console.ParseRole(prefix); err == nil {
				if rest == "" {
					return nil, fmt.Errorf("--token entry %d (%s:) has no token after the role", i+1, prefix)
				}
				t = consoleToken{token: []byte(rest), role: role, named: true}
			}
		}
		for _, o := range out {
			if subtle.ConstantTimeCompare(o.token, t.token) == 1 {
				return nil, fmt.Errorf("--token entry %d repeats an earlier token: give each role its own token", i+1)
			}
		}
		out = append(out, t)
	}
	return out, nil
}

func isLoopback(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// loopbackHostOnly refuses requests whose Host is not a loopback name: an
// unauthenticated console must not answer a page that rebound a domain
// name to 127.0.0.1.
func loopbackHostOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := r.Host
		if h, _, err := net.SplitHostPort(r.Host); err == nil {
			host = h
		}
		ip := net.ParseIP(strings.Trim(host, "[]"))
		if host != "localhost" && (ip == nil || !ip.IsLoopback()) {
			http.Error(w, "millwright console: without authentication only loopback hosts are served (Host "+r.Host+")", http.StatusMisdirectedRequest)
			return
		}
		next.ServeHTTP(w, r)
	})
}

const consoleRealm = `Basic realm="millwright console", charset="UTF-8"`

func unauthorized(w http.ResponseWriter) {
	w.Header().Set("WWW-Authenticate", consoleRealm)
	http.Error(w, "millwright console: authentication required", http.StatusUnauthorized)
}

// tokenAuth accepts a bearer token of the list, or basic auth with a
// token as the password and the user name as the operator; the token's
// entry gives the role.
func tokenAuth(tokens []consoleToken) identify {
	match := func(got string) (consoleToken, bool) {
		var found consoleToken
		ok := false
		for _, t := range tokens { // every entry compared: no early exit
			if subtle.ConstantTimeCompare([]byte(got), t.token) == 1 {
				found, ok = t, true
			}
		}
		return found, ok
	}
	return func(w http.ResponseWriter, r *http.Request) (console.Identity, bool) {
		if bearer, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			if t, ok := match(bearer); ok {
				name := "token"
				if t.named {
					name = string(t.role) + " token"
				}
				return console.Identity{Name: name, Role: t.role}, true
			}
		} else if user, pass, ok := r.BasicAuth(); ok && user != "" {
			if t, ok := match(pass); ok {
				return console.Identity{Name: user, Role: t.role}, true
			}
		}
		unauthorized(w)
		return console.Identity{}, false
	}
}

// basicUser is one --basic-auth-file line.
type basicUser struct {
	hash []byte
	role console.Role
}

// readBasicAuthFile reads user:bcrypt-hash[:role] lines (no role: admin);
// blank lines and lines starting with # are skipped.
func readBasicAuthFile(path string) (map[string]basicUser, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--basic-auth-file: %w", err)
	}
	defer f.Close()
	return parseBasicAuth(f, path)
}

func parseBasicAuth(r io.Reader, path string) (map[string]basicUser, error) {
	users := map[string]basicUser{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		user, hash, ok := strings.Cut(line, ":")
		if !ok || user == "" {
			return nil, fmt.Errorf("--basic-auth-file %s line %d: want user:bcrypt-hash[:role] (htpasswd -nbB user password; role viewer, operator or admin)", path, n)
		}
		role := console.RoleAdmin
		// A bcrypt hash has no colon: a third field is the role.
		if h, r, ok := strings.Cut(hash, ":"); ok {
			var err error
			if role, err = console.ParseRole(r); err != nil {
				return nil, fmt.Errorf("--basic-auth-file %s line %d (user %q): %v", path, n, user, err)
			}
			hash = h
		}
		if _, err := bcrypt.Cost([]byte(hash)); err != nil {
			return nil, fmt.Errorf("--basic-auth-file %s line %d (user %q): the password is not a bcrypt hash (make one with htpasswd -nbB user password): %v", path, n, user, err)
		}
		users[user] = basicUser{hash: []byte(hash), role: role}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("--basic-auth-file %s: %w", path, err)
	}
	if len(users) == 0 {
		return nil, fmt.Errorf("--basic-auth-file %s has no user: add user:bcrypt-hash lines (htpasswd -nbB user password)", path)
	}
	return users, nil
}

func basicAuthOf(users map[string]basicUser) identify {
	return func(w http.ResponseWriter, r *http.Request) (console.Identity, bool) {
		user, pass, ok := r.BasicAuth()
		if u, known := users[user]; ok && known && bcrypt.CompareHashAndPassword(u.hash, []byte(pass)) == nil {
			return console.Identity{Name: user, Role: u.role}, true
		}
		unauthorized(w)
		return console.Identity{}, false
	}
}
