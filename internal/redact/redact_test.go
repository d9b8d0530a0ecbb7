package redact_test

import (
	"errors"
	"io/fs"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/redact"
)

const secret = "Sup3rS3cretPW"

func TestTextHidesSecrets(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"postgres://postgres:" + secret + "@127.0.0.1:5432/test?sslmode=disable",
		`parse "postgres://app:` + secret + `@db:badport/orders": invalid port ":badport" after host`,
		"kafka://b:9092?sasl_user=u&sasl_password=" + secret,
		"host=h user=u password=" + secret + " dbname=d",
		"host=h password='" + secret + " x' dbname=d",
		`token="` + secret + `"`,
		"amqp://g:" + secret + "@r/ and amqps://h:" + secret + "@s/",
		"http://%zz:" + secret + "@host/",
	} {
		got := redact.Text(in)
		require.NotContains(t, got, secret, "from %q", in)
	}
	require.Equal(t, "no secrets here: topic=orders", redact.Text("no secrets here: topic=orders"))
	require.Equal(t, `parse "postgres://app:xxxxx@db:badport/orders": invalid port`,
		redact.Text(`parse "postgres://app:`+secret+`@db:badport/orders": invalid port`), "a URL net/url refuses keeps its shape")
	require.Equal(t, "x://u:xxxxx@h:badport/p?password=xxxxx", redact.Text("x://u:p/w@d@h:badport/p?password="+secret))
	require.Equal(t, "dial postgres://u:xxxxx@h:5432/db?sslmode=disable: refused",
		redact.Text("dial postgres://u:"+secret+"@h:5432/db?sslmode=disable: refused"))
}

func TestQuerySecretsAreMasked(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"postgres://u@127.0.0.1:1/db?sslmode=disable&password=" + secret,
		"postgres://u@127.0.0.1:1/db?sslpassword=" + secret + "&sslmode=require",
		"kafka://b1:9092,b2:9092?sasl=SCRAM-SHA-256&sasl_user=svc&sasl_password=" + secret,
		"gcppubsub://proj?emulator=127.0.0.1:8085&credentials=" + secret,
		"gcppubsub://proj?emulator_auth_token=" + secret,
		"https://h/x?authorization=Bearer%20" + secret,
		"amqp://h/?auth_mechanism=PLAIN&jwt=" + secret,
	} {
		require.NotContains(t, redact.URL(in), secret, "URL(%q)", in)
		require.NotContains(t, redact.Text("connecting to "+in+": refused"), secret, "Text of %q", in)
	}
	require.Equal(t, "postgres://u@127.0.0.1:1/db?password=xxxxx&sslmode=disable",
		redact.URL("postgres://u@127.0.0.1:1/db?sslmode=disable&password="+secret))
}

func TestErrorOfMasksTheURLsSecretsAnywhere(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{
		"postgres://u:" + secret + "@h/db",
		"postgres://u@h/db?password=" + secret,
		"postgres://u:" + secret + "@h:badport/db", // net/url refuses it
	} {
		// A driver quoting the secret outside any URL.
		err := redact.ErrorOf(errors.Join(fs.ErrNotExist, errors.New("auth failed with "+secret)), raw)
		require.NotContains(t, err.Error(), secret, raw)
		require.ErrorIs(t, err, fs.ErrNotExist)
	}
	plain := errors.New("refused")
	require.Same(t, plain, redact.ErrorOf(plain, "postgres://u:"+secret+"@h/db"))
	require.NoError(t, redact.ErrorOf(nil, "x"))
}

func TestErrorKeepsTheChain(t *testing.T) {
	t.Parallel()
	base := errors.Join(fs.ErrNotExist, errors.New("open postgres://u:"+secret+"@h/db"))
	err := redact.Error(base)
	require.NotContains(t, err.Error(), secret)
	require.ErrorIs(t, err, fs.ErrNotExist)
	plain := errors.New("nothing to hide")
	require.Same(t, plain, redact.Error(plain))
	require.NoError(t, redact.Error(nil))
}

func TestLoggerRedactsMessageErrorAndFields(t *testing.T) {
	t.Parallel()
	var b strings.Builder
	l := redact.Logger(watermill.NewStdLoggerWithOut(&b, true, true))
	require.Equal(t, l, redact.Logger(l), "not wrapped twice")
	url := "postgres://u:" + secret + "@h/db"
	l.Error("failed at "+url, errors.New("dial "+url), watermill.LogFields{"dsn": url, "password": secret, "n": 3, "err": errors.New(url)})
	l.Info("info "+url, watermill.LogFields{"dsn": url})
	l.Debug("debug", watermill.LogFields{"x": "password=" + secret})
	l.With(watermill.LogFields{"dsn": url}).Trace("trace", nil)
	out := b.String()
	require.NotContains(t, out, secret)
	require.Equal(t, 4, strings.Count(out, "\n"), out)
	require.Contains(t, out, "n=3")
}

func TestJSONMasksSecretKeysAndURLPasswords(t *testing.T) {
	t.Parallel()
	got := redact.JSON([]byte(`{"order_id":"o-1","amount":12.50,"card":{"api_token":"tok_123","last4":"4242"},"password":7,
		"callbacks":["postgres://u:hunter2@db/x"],"n":12345678901234567890}`))
	require.JSONEq(t, `{"order_id":"o-1","amount":12.50,"card":{"api_token":"xxxxx","last4":"4242"},"password":"xxxxx",
		"callbacks":["postgres://u:xxxxx@db/x"],"n":12345678901234567890}`, string(got))
	require.NotContains(t, string(got), "hunter2")
	require.NotContains(t, string(got), "tok_123")
	require.Equal(t, "not json token=xxxxx", string(redact.JSON([]byte("not json token=abc"))))
}
