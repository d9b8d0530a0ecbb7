package pgtls_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"database/sql"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/lib/pq"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/testing/pgtest"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/sql" // registers sql
)

// envRequireTLS, set to 1, makes the test fail where it would skip: for
// CI machines that must prove verified TLS, as MILLWRIGHT_TEST_REAL_BROKERS
// does for the brokers.
const envRequireTLS = "MILLWRIGHT_TEST_REQUIRE_TLS"

// skip skips the test, saying why on stderr as well (seen without -v), or
// fails it under MILLWRIGHT_TEST_REQUIRE_TLS=1.
func skip(t *testing.T, format string, args ...any) {
	t.Helper()
	why := fmt.Sprintf(format, args...)
	if os.Getenv(envRequireTLS) == "1" {
		t.Fatalf("pgtls: %s (%s=1: the TLS test must run)", why, envRequireTLS)
	}
	fmt.Fprintf(os.Stderr, "pgtls: SKIPPED, verified TLS to Postgres NOT tested: %s (set %s=1 to fail instead)\n", why, envRequireTLS)
	t.Skipf("pgtls: %s", why)
}

// installDirName marks the directory of the test's certificate files, so a
// run killed before its cleanup is recognised and undone by the next one.
const installDirName = "millwright-test-tls"

type pki struct {
	caPEM               []byte
	certPEM, keyPEM     []byte
	otherCAPEM          []byte // a CA that did not sign the server certificate
	caFile, otherCAFile string
}

func newCA(t *testing.T, name string) (*x509.Certificate, *ecdsa.PrivateKey, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(time.Now().UnixNano()),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	return cert, key, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	ca, caKey, caPEM := newCA(t, "millwright test CA")
	_, _, otherPEM := newCA(t, "some other CA")
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano() + 1),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("::1")},
		DNSNames:     []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	require.NoError(t, err)
	keyDER, err := x509.MarshalECPrivateKey(key)
	require.NoError(t, err)
	p := &pki{
		caPEM: caPEM, otherCAPEM: otherPEM,
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		keyPEM:  pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}),
	}
	dir := t.TempDir()
	p.caFile, p.otherCAFile = filepath.Join(dir, "ca.pem"), filepath.Join(dir, "other-ca.pem")
	require.NoError(t, os.WriteFile(p.caFile, p.caPEM, 0o600))
	require.NoError(t, os.WriteFile(p.otherCAFile, p.otherCAPEM, 0o600))
	return p
}

// setting is one server setting and where it came from.
type setting struct {
	name, value, source, sourcefile string
}

func readSetting(t *testing.T, db *sql.DB, name string) setting {
	t.Helper()
	s := setting{name: name}
	require.NoError(t, db.QueryRow(`SELECT setting, source, COALESCE(sourcefile, '') FROM pg_settings WHERE name = $1`, name).
		Scan(&s.value, &s.source, &s.sourcefile))
	return s
}

// restoreStatement returns the ALTER SYSTEM statement that puts s back:
// RESET when it did not come from postgresql.auto.conf (or came from a
// killed run of this test), SET to the old value otherwise.
func restoreStatement(s setting) string {
	if !strings.HasSuffix(s.sourcefile, "postgresql.auto.conf") || strings.Contains(s.value, installDirName) {
		return `ALTER SYSTEM RESET ` + s.name
	}
	return fmt.Sprintf(`ALTER SYSTEM SET %s = '%s'`, s.name, strings.ReplaceAll(s.value, `'`, `''`))
}

func reload(t *testing.T, db *sql.DB) {
	t.Helper()
	_, err := db.Exec(`SELECT pg_reload_conf()`)
	require.NoError(t, err)
}

// install puts the server certificate where the server's OS user owns it
// and points the server at it; it skips the test when it cannot.
func install(t *testing.T, admin *sql.DB, p *pki) {
	t.Helper()
	var super bool
	require.NoError(t, admin.QueryRow(`SELECT rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&super))
	if !super {
		skip(t, "the test database user is not a superuser: cannot ALTER SYSTEM the server's ssl settings")
	}
	var dataDir string
	require.NoError(t, admin.QueryRow(`SELECT current_setting('data_directory')`).Scan(&dataDir))
	fi, err := os.Stat(dataDir)
	if err != nil {
		skip(t, "the server's data directory %s is not on this machine (%v): cannot install certificate files", dataDir, err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		skip(t, "cannot read the data directory's owner on this OS")
	}
	uid, gid := int(st.Uid), int(st.Gid)

	// Files beside the data directory, owned by the server's user: they
	// outlive a killed run, so a server restart before the next run's
	// cleanup still finds them.
	dir := filepath.Join(filepath.Dir(dataDir), installDirName)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		skip(t, "cannot create %s: %v", dir, err)
	}
	certFile, keyFile := filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")
	for _, f := range []struct {
		path string
		data []byte
	}{{certFile, p.certPEM}, {keyFile, p.keyPEM}} {
		if err := os.WriteFile(f.path, f.data, 0o600); err != nil {
			skip(t, "cannot write %s: %v", f.path, err)
		}
		if err := os.Chown(f.path, uid, gid); err != nil {
			skip(t, "cannot give %s to the server's user (uid %d; run as root or as that user): %v", f.path, uid, err)
		}
		require.NoError(t, os.Chmod(f.path, 0o600))
	}
	if err := os.Chown(dir, uid, gid); err != nil {
		skip(t, "cannot give %s to the server's user: %v", dir, err)
	}

	prev := []setting{readSetting(t, admin, "ssl"), readSetting(t, admin, "ssl_cert_file"), readSetting(t, admin, "ssl_key_file")}
	t.Cleanup(func() {
		for _, s := range prev {
			if _, err := admin.Exec(restoreStatement(s)); err != nil {
				t.Errorf("pgtls: restoring %s (fix by hand: ALTER SYSTEM RESET %s; SELECT pg_reload_conf()): %v", s.name, s.name, err)
			}
		}
		if _, err := admin.Exec(`SELECT pg_reload_conf()`); err != nil {
			t.Errorf("pgtls: reloading the restored configuration: %v", err)
		}
		// The files stay until the server has reloaded away from them.
		deadline := time.Now().Add(10 * time.Second)
		for time.Now().Before(deadline) {
			var f string
			if admin.QueryRow(`SELECT setting FROM pg_settings WHERE name = 'ssl_cert_file'`).Scan(&f) == nil && f != certFile {
				_ = os.RemoveAll(dir)
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
		t.Errorf("pgtls: the server still uses %s after restoring; left in place", certFile)
	})
	for _, stmt := range []string{
		`ALTER SYSTEM SET ssl_cert_file = '` + certFile + `'`,
		`ALTER SYSTEM SET ssl_key_file = '` + keyFile + `'`,
		`ALTER SYSTEM SET ssl = on`,
	} {
		_, err := admin.Exec(stmt)
		require.NoError(t, err, stmt)
	}
	reload(t, admin)
}

// verifyFullURL is the test server's URL with verified TLS against ca.
func verifyFullURL(t *testing.T, base, ca, appName string) string {
	t.Helper()
	u, err := url.Parse(base)
	require.NoError(t, err)
	u.Host = "127.0.0.1:" + u.Port()
	q := u.Query()
	q.Set("sslmode", "verify-full")
	q.Set("sslrootcert", ca)
	q.Set("application_name", appName)
	u.RawQuery = q.Encode()
	return u.String()
}

func sslInUse(t *testing.T, db *sql.DB) bool {
	t.Helper()
	var on bool
	require.NoError(t, db.QueryRow(`SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()`).Scan(&on))
	return on
}

// TestVerifiedTLSToPostgres: not parallel with itself (one server
// configuration); other packages' sslmode=disable connections are
// unaffected.
func TestVerifiedTLSToPostgres(t *testing.T) {
	admin, err := sql.Open("postgres", pgtest.BaseURL())
	require.NoError(t, err)
	admin.SetMaxOpenConns(1)
	t.Cleanup(func() { admin.Close() })
	if err := admin.Ping(); err != nil {
		skip(t, "no Postgres at %s: %v", pgtest.EnvDatabaseURL, err)
	}
	p := newPKI(t)
	install(t, admin, p)

	s := pgtest.New(t) // created over sslmode=disable while ssl is on
	s.DB.SetMaxOpenConns(1)
	appName := "mw_tls_" + s.Name
	tlsURL := verifyFullURL(t, s.URL, p.caFile, appName)

	// The reload is asynchronous: wait until new connections get the new
	// certificate, or report why the server refused it.
	db, err := sql.Open("postgres", tlsURL)
	require.NoError(t, err)
	db.SetMaxOpenConns(1)
	t.Cleanup(func() { db.Close() })
	deadline := time.Now().Add(15 * time.Second)
	for {
		db.SetMaxIdleConns(0) // each try dials anew
		if err = db.Ping(); err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		var problems []string
		rows, qerr := admin.Query(`SELECT name || ': ' || error FROM pg_file_settings WHERE error IS NOT NULL`)
		if qerr == nil {
			for rows.Next() {
				var p string
				_ = rows.Scan(&p)
				problems = append(problems, p)
			}
			rows.Close()
		}
		t.Fatalf("verify-full connection after installing the certificate: %v (server configuration errors: %v)", err, problems)
	}
	db.SetMaxIdleConns(1)
	require.True(t, sslInUse(t, db), "plain lib/pq pool with sslmode=verify-full")

	t.Run("transport sql over verify-full", func(t *testing.T) {
		cfg, err := transport.ParseURL(tlsURL)
		require.NoError(t, err)
		cfg.SQL.MaxOpenConns = 2
		tr, err := transport.Open(context.Background(), cfg)
		require.NoError(t, err)
		defer tr.Close()
		sub, err := tr.Subscriber("tls")
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		msgs, err := sub.Subscribe(ctx, "tls_orders")
		require.NoError(t, err)
		sent := message.NewMessage(watermill.NewUUID(), []byte(`{"over":"tls"}`))
		require.NoError(t, tr.Publisher().Publish("tls_orders", sent))
		select {
		case got := <-msgs:
			got.Ack()
			require.Equal(t, sent.UUID, got.UUID)
		case <-ctx.Done():
			t.Fatal("no message over the TLS transport within 30s")
		}
		// Every connection of the transport's own pool (told apart by
		// application_name) is encrypted.
		var conns, encrypted int
		require.NoError(t, admin.QueryRow(`SELECT count(*), count(*) FILTER (WHERE s.ssl)
			FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = $1`, appName).Scan(&conns, &encrypted))
		require.Positive(t, conns)
		require.Equal(t, conns, encrypted, "transport connections without TLS")
	})

	t.Run("wrong CA is refused", func(t *testing.T) {
		bad, err := sql.Open("postgres", verifyFullURL(t, s.URL, p.otherCAFile, appName+"_bad"))
		require.NoError(t, err)
		defer bad.Close()
		err = bad.Ping()
		require.Error(t, err)
		require.Contains(t, err.Error(), "certificate")
	})

	t.Run("sslmode=disable still works while ssl is on", func(t *testing.T) {
		require.False(t, sslInUse(t, s.DB))
	})
}
