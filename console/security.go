package console

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"net/http"
	"net/url"
)

// contentSecurityPolicy allows the console's own stylesheet and script and
// nothing else: no inline script or style (a payload that got past the
// escaping still could not run), no frames around it, forms only to
// itself.
const contentSecurityPolicy = "default-src 'none'; style-src 'self'; script-src 'self'; img-src 'self'; " +
	"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

func setSecurityHeaders(h http.Header) {
	h.Set("Content-Security-Policy", contentSecurityPolicy)
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cross-Origin-Opener-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
}

type actorKey struct{}

// WithActor returns ctx carrying the operator's name, for ContextActor: a
// host's authentication middleware calls it before the console.
func WithActor(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, actorKey{}, name)
}

// ContextActor is a Config.Authenticate for hosts that authenticate in
// their own middleware: the name WithActor put in the request's context,
// or a 401 when there is none.
func ContextActor(w http.ResponseWriter, r *http.Request) (string, bool) {
	if name, _ := r.Context().Value(actorKey{}).(string); name != "" {
		return name, true
	}
	http.Error(w, "console: not authenticated (the host's middleware set no operator with console.WithActor)", http.StatusUnauthorized)
	return "", false
}

func actorOf(r *http.Request) string {
	name, _ := r.Context().Value(actorKey{}).(string)
	return name
}

// The CSRF defence is a signed double submit: a random value in an
// HttpOnly, SameSite=Strict cookie, and in every form its HMAC with the
// operator's name under Config.CSRFKey. A POST must bring both, matching;
// a cross-site page can neither read the cookie nor compute the token.
// Origin and Sec-Fetch-Site, when the browser sends them, must say the
// request comes from the console's own origin.
const csrfCookie = "millwright_console_csrf"

// csrfToken returns the form token of the request, setting the cookie
// when it has none.
func (h *Handler) csrfToken(w http.ResponseWriter, r *http.Request) string {
	c, err := r.Cookie(csrfCookie)
	if err != nil || len(c.Value) < 32 {
		var b [32]byte
		_, _ = rand.Read(b[:])
		c = &http.Cookie{Name: csrfCookie, Value: base64.RawURLEncoding.EncodeToString(b[:]), Path: h.cookiePath(),
			HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil}
		http.SetCookie(w, c)
		// The forms of this very page carry the token of the new cookie.
		r.AddCookie(c)
	}
	return h.sign(c.Value, actorOf(r))
}

func (h *Handler) cookiePath() string {
	if h.cfg.BasePath == "" {
		return "/"
	}
	return h.cfg.BasePath
}

func (h *Handler) sign(cookie, actor string) string {
	m := hmac.New(sha256.New, h.cfg.CSRFKey)
	m.Write([]byte(cookie))
	m.Write([]byte{0})
	m.Write([]byte(actor))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

var (
	errCrossSite = errors.New("refused: the request comes from another site (Origin or Sec-Fetch-Site); use the console's own pages")
	errNoToken   = errors.New("refused: the form's CSRF token is missing or does not match; reload the page and try again")
)

// checkPost refuses a state-changing request that is cross-site or lacks
// a valid CSRF token.
func (h *Handler) checkPost(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodPost {
		return errors.New("refused: the console changes state only through POST forms")
	}
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
		return errCrossSite
	}
	if origin := r.Header.Get("Origin"); origin != "" {
		u, err := url.Parse(origin)
		if err != nil || u.Host != r.Host {
			return errCrossSite
		}
	}
	c, err := r.Cookie(csrfCookie)
	if err != nil || c.Value == "" {
		return errNoToken
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		return errNoToken
	}
	got := r.PostForm.Get("csrf")
	want := h.sign(c.Value, actorOf(r))
	if subtle.ConstantTimeCompare([]byte(got), []byte(want)) != 1 {
		return errNoToken
	}
	return nil
}
