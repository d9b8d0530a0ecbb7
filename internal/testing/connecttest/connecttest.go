// Package connecttest drives a Kafka Connect worker's REST API for the
// Debezium tests and `millwright-bench debezium`: create a connector, wait
// until its task runs, stop it (offsets flushed), delete it.
package connecttest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"testing"
	"time"
)

// Environment variables: the worker's REST URL (scripts/connect.sh up
// exports it), and, set by CI, the demand that the tests needing it run.
const (
	EnvURL     = "MILLWRIGHT_TEST_CONNECT_URL"
	EnvRequire = "MILLWRIGHT_TEST_REQUIRE_CONNECT"
)

// Client talks to one worker.
type Client struct {
	URL  string
	HTTP *http.Client
}

// FromEnv returns a client of the worker named by EnvURL; without it the
// test is skipped, or fails when EnvRequire is set.
func FromEnv(tb testing.TB) *Client {
	tb.Helper()
	u := os.Getenv(EnvURL)
	if u == "" {
		if os.Getenv(EnvRequire) != "" {
			tb.Fatalf("%s is set but %s is not: run `eval \"$(scripts/connect.sh up)\"`", EnvRequire, EnvURL)
		}
		tb.Skipf("%s not set: run `eval \"$(scripts/connect.sh up)\"` to run the Debezium tests", EnvURL)
	}
	return New(u)
}

// New returns a client of the worker at rawURL.
func New(rawURL string) *Client {
	return &Client{URL: rawURL, HTTP: &http.Client{Timeout: 30 * time.Second}}
}

func (c *Client) do(ctx context.Context, method, path string, body any, out any) (int, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.URL+path, rd)
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return 0, fmt.Errorf("kafka connect %s %s (is the worker up? scripts/connect.sh up): %w", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode >= 300 {
		return resp.StatusCode, fmt.Errorf("kafka connect %s %s: %s: %s", method, path, resp.Status, b)
	}
	if out != nil && len(b) > 0 {
		if err := json.Unmarshal(b, out); err != nil {
			return resp.StatusCode, fmt.Errorf("kafka connect %s %s: %w", method, path, err)
		}
	}
	return resp.StatusCode, nil
}

// Put creates or reconfigures connector name.
func (c *Client) Put(ctx context.Context, name string, config map[string]string) error {
	_, err := c.do(ctx, http.MethodPut, "/connectors/"+url.PathEscape(name)+"/config", config, nil)
	return err
}

// Status is a connector's state and its tasks'.
type Status struct {
	Connector struct {
		State string `json:"state"`
		Trace string `json:"trace"`
	} `json:"connector"`
	Tasks []struct {
		State string `json:"state"`
		Trace string `json:"trace"`
	} `json:"tasks"`
}

// Status reads connector name's status.
func (c *Client) Status(ctx context.Context, name string) (Status, error) {
	var s Status
	_, err := c.do(ctx, http.MethodGet, "/connectors/"+url.PathEscape(name)+"/status", nil, &s)
	return s, err
}

// WaitState waits until the connector, and every task it has, is in
// state (RUNNING; STOPPED has no tasks), or ctx ends. A FAILED task ends
// the wait with its trace.
func (c *Client) WaitState(ctx context.Context, name, state string) error {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	var last Status
	for {
		s, err := c.Status(ctx, name)
		if err == nil {
			last = s
			for _, tk := range s.Tasks {
				if tk.State == "FAILED" {
					return fmt.Errorf("connector %s: task failed: %s", name, tk.Trace)
				}
			}
			if s.Connector.State == "FAILED" {
				return fmt.Errorf("connector %s failed: %s", name, s.Connector.Trace)
			}
			if s.Connector.State == state && (state != "RUNNING" || len(s.Tasks) > 0) && allTasks(s, state) {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("connector %s not %s (last status %+v): %w", name, state, last, ctx.Err())
		case <-t.C:
		}
	}
}

func allTasks(s Status, state string) bool {
	for _, tk := range s.Tasks {
		if tk.State != state {
			return false
		}
	}
	return true
}

// Stop stops connector name (Kafka 3.5's stop: its task ends after
// committing its offsets, its configuration stays) and waits for it.
func (c *Client) Stop(ctx context.Context, name string) error {
	if _, err := c.do(ctx, http.MethodPut, "/connectors/"+url.PathEscape(name)+"/stop", nil, nil); err != nil {
		return err
	}
	return c.WaitState(ctx, name, "STOPPED")
}

// Delete removes connector name; a connector that does not exist is no
// error.
func (c *Client) Delete(ctx context.Context, name string) error {
	code, err := c.do(ctx, http.MethodDelete, "/connectors/"+url.PathEscape(name), nil, nil)
	if code == http.StatusNotFound {
		return nil
	}
	return err
}
