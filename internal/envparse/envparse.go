// Package envparse holds the value parsers that package transport and its
// kind sub-packages share to read MILLWRIGHT_ variables and transport URLs,
// so that every kind reads a list, a boolean or a CA file the same way and
// says so with the same words.
package envparse

import (
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// List splits a comma-separated value, dropping blanks around and between
// items.
func List(v string) []string {
	var out []string
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, s)
		}
	}
	return out
}

// Bool parses v ("" is false); the error names the setting name.
func Bool(name, v string) (bool, error) {
	if v == "" {
		return false, nil
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		return false, fmt.Errorf("%s=%q: want true or false", name, v)
	}
	return b, nil
}

// TLS builds a TLS configuration (TLS 1.2 at least) from a CA file ("" =
// the system roots).
func TLS(caFile string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("reading CA file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("CA file %s holds no PEM certificate", caFile)
		}
		c.RootCAs = pool
	}
	return c, nil
}

// Short cuts v for an error message.
func Short(v string) string {
	if len(v) > 64 {
		return v[:64] + "..."
	}
	return v
}
