package main

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/millwright/millwright/console"
)

func TestConsoleTokenListGivesEachTokenItsRole(t *testing.T) {
	t.Parallel()
	tokens, err := parseTokens("viewer:tv, operator:to,admin:ta,bare")
	require.NoError(t, err)
	auth := tokenAuth(tokens)
	for _, c := range []struct {
		bearer, user, pass string
		want               console.Identity
		ok                 bool
	}{
		{bearer: "tv", want: console.Identity{Name: "viewer token", Role: console.RoleViewer}, ok: true},
		{bearer: "to", want: console.Identity{Name: "operator token", Role: console.RoleOperator}, ok: true},
		{bearer: "ta", want: console.Identity{Name: "admin token", Role: console.RoleAdmin}, ok: true},
		{bearer: "bare", want: console.Identity{Name: "token", Role: console.RoleAdmin}, ok: true},
		{user: "vic", pass: "tv", want: console.Identity{Name: "vic", Role: console.RoleViewer}, ok: true},
		{bearer: "viewer:tv"},
		{user: "vic", pass: "nope"},
	} {
		req, _ := http.NewRequest(http.MethodGet, "/", nil)
		if c.bearer != "" {
			req.Header.Set("Authorization", "Bearer "+c.bearer)
		} else {
			req.SetBasicAuth(c.user, c.pass)
		}
		rec := &headerRecorder{h: http.Header{}}
		id, ok := auth(rec, req)
		require.Equal(t, c.ok, ok, c)
		if ok {
			require.Equal(t, c.want, id)
		} else {
			require.Equal(t, http.StatusUnauthorized, rec.code)
		}
	}
	// A token with a colon whose prefix is no role is a bare (admin) token.
	tokens, err = parseTokens("abc:def")
	require.NoError(t, err)
	require.Equal(t, console.RoleAdmin, tokens[0].role)
	require.Equal(t, "abc:def", string(tokens[0].token))

	_, err = parseTokens("viewer:a,,admin:b")
	require.ErrorContains(t, err, "entry 2 is empty")
	_, err = parseTokens("viewer:")
	require.ErrorContains(t, err, "no token after the role")
	_, err = parseTokens("viewer:same,admin:same")
	require.ErrorContains(t, err, "repeats an earlier token")
}

func TestBasicAuthFileTakesARoleColumn(t *testing.T) {
	t.Parallel()
	hash, err := bcrypt.GenerateFromPassword([]byte("pw"), bcrypt.MinCost)
	require.NoError(t, err)
	h := string(hash)
	users, err := parseBasicAuth(strings.NewReader("vic:"+h+":viewer\nola:"+h+":Operator\nada:"+h+"\n"), "f")
	require.NoError(t, err)
	auth := basicAuthOf(users)
	for user, role := range map[string]console.Role{"vic": console.RoleViewer, "ola": console.RoleOperator, "ada": console.RoleAdmin} {
		req, _ := http.NewRequest(http.MethodGet, "/", nil)
		req.SetBasicAuth(user, "pw")
		id, ok := auth(&headerRecorder{h: http.Header{}}, req)
		require.True(t, ok, user)
		require.Equal(t, console.Identity{Name: user, Role: role}, id)
	}
	_, err = parseBasicAuth(strings.NewReader("vic:"+h+":root\n"), "f")
	require.ErrorContains(t, err, `line 1 (user "vic"): console: role "root": want one of viewer, operator, admin`)
}
