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
actions are recorded as the OS user running the console.`,
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
	cfg := console.Config{Authenticate: auth, BasePath: basePath, Logger: redact.Logger(watermill.NewStdLoggerWithOut(cmd.ErrOrStderr(), false, false))}
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
func consoleAuth(listen, token, authFile string) (func(http.ResponseWriter, *http.Request) (string, bool), string, error) {
	switch {
	case token != "" && authFile != "":
		return nil, "", errors.New("--token and --basic-auth-file: pass one of them")
	case token != "":
		return tokenAuth(token), "token", nil
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
	return func(http.ResponseWriter, *http.Request) (string, bool) { return user, true }, "none (loopback only; actions recorded as " + user + ")", nil
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

// tokenAuth accepts the bearer token, or basic auth with the token as the
// password and the user name as the operator.
func tokenAuth(token string) func(http.ResponseWriter, *http.Request) (string, bool) {
	want := []byte(token)
	return func(w http.ResponseWriter, r *http.Request) (string, bool) {
		if bearer, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			if subtle.ConstantTimeCompare([]byte(bearer), want) == 1 {
				return "token", true
			}
		} else if user, pass, ok := r.BasicAuth(); ok && user != "" && subtle.ConstantTimeCompare([]byte(pass), want) == 1 {
			return user, true
		}
		unauthorized(w)
		return "", false
	}
}

// readBasicAuthFile reads user:bcrypt-hash lines; blank lines and lines
// starting with # are skipped.
func readBasicAuthFile(path string) (map[string][]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--basic-auth-file: %w", err)
	}
	defer f.Close()
	return parseBasicAuth(f, path)
}

func parseBasicAuth(r io.Reader, path string) (map[string][]byte, error) {
	users := map[string][]byte{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		user, hash, ok := strings.Cut(line, ":")
		if !ok || user == "" {
			return nil, fmt.Errorf("--basic-auth-file %s line %d: want user:bcrypt-hash (htpasswd -nbB user password)", path, n)
		}
		if _, err := bcrypt.Cost([]byte(hash)); err != nil {
			return nil, fmt.Errorf("--basic-auth-file %s line %d (user %q): the password is not a bcrypt hash (make one with htpasswd -nbB user password): %v", path, n, user, err)
		}
		users[user] = []byte(hash)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("--basic-auth-file %s: %w", path, err)
	}
	if len(users) == 0 {
		return nil, fmt.Errorf("--basic-auth-file %s has no user: add user:bcrypt-hash lines (htpasswd -nbB user password)", path)
	}
	return users, nil
}

func basicAuthOf(users map[string][]byte) func(http.ResponseWriter, *http.Request) (string, bool) {
	return func(w http.ResponseWriter, r *http.Request) (string, bool) {
		user, pass, ok := r.BasicAuth()
		if hash, known := users[user]; ok && known && bcrypt.CompareHashAndPassword(hash, []byte(pass)) == nil {
			return user, true
		}
		unauthorized(w)
		return "", false
	}
}
