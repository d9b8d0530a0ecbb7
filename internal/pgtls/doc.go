// Package pgtls proves that millwright reaches Postgres over verified TLS:
// its test generates a CA and a server certificate, installs them on the
// local server (when the test runs as the server's OS user or root, and
// connects as a superuser), and connects with sslmode=verify-full through
// transport/sql and through a plain lib/pq pool, checking pg_stat_ssl.
//
// How to configure TLS for Postgres in an application: put the libpq
// parameters in the URL,
//
//	postgres://app:pass@db.internal:5432/orders?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem
//
// (sslcert and sslkey add a client certificate). See docs/security.md.
//
// The package has no API; the test restores the server's previous
// ssl_cert_file and ssl_key_file at cleanup, and connections with
// sslmode=disable (every other test) are unaffected while it runs.
package pgtls
