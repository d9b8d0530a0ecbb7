package main

import (
	"net/url"
	"os"

	_ "github.com/lib/pq" // registers the "postgres" driver
)

// defaultDatabaseURL is the local development server.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

func databaseURL(flag string) string {
	if flag != "" {
		return flag
	}
	if u := os.Getenv("MILLWRIGHT_DATABASE_URL"); u != "" {
		return u
	}
	return defaultDatabaseURL
}

// redactURL hides the password of a URL so it can be printed.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparseable URL>"
	}
	return u.Redacted()
}
