package envparse

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestList(t *testing.T) {
	t.Parallel()
	if got := strings.Join(List(" a, ,b ,,"), "|"); got != "a|b" {
		t.Fatalf("List = %q, want a|b", got)
	}
	if List(" , ") != nil {
		t.Fatal("a list of blanks is empty")
	}
}

func TestBool(t *testing.T) {
	t.Parallel()
	if b, err := Bool("X", ""); b || err != nil {
		t.Fatalf(`Bool("") = %v, %v: want false, nil`, b, err)
	}
	if b, err := Bool("X", "1"); !b || err != nil {
		t.Fatalf(`Bool("1") = %v, %v: want true, nil`, b, err)
	}
	if _, err := Bool("MILLWRIGHT_X", "yes"); err == nil || err.Error() != `MILLWRIGHT_X="yes": want true or false` {
		t.Fatalf(`Bool("yes") error = %v`, err)
	}
}

func TestTLS(t *testing.T) {
	t.Parallel()
	c, err := TLS("")
	if err != nil || c.RootCAs != nil {
		t.Fatalf(`TLS("") = %v, %v: want the system roots`, c, err)
	}
	bad := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(bad, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := TLS(bad); err == nil || !strings.Contains(err.Error(), "holds no PEM certificate") {
		t.Fatalf("TLS(bad) error = %v", err)
	}
}
