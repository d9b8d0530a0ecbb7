package health_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"

	"github.com/millwright/millwright/health"
)

// A service mounts the handler beside its own routes; here the database
// check passes and a router that has not started yet fails readiness.
func Example() {
	h, err := health.NewHandler(health.Config{})
	if err != nil {
		panic(err)
	}
	h.Add("database", health.CheckerFunc(func(context.Context) error { return nil })) // health.Ping(db)
	h.Add("router", health.Router(notStarted{}))                                      // health.Router(router)

	srv := httptest.NewServer(h)
	defer srv.Close()
	for _, path := range []string{health.PathLive, health.PathReady} {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			panic(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%s %d\n%s", path, resp.StatusCode, body)
	}
	// Output:
	// /healthz 200
	// ok
	// /readyz 503
	// [+]database ok
	// [-]router failed: not running: Router.Run has not subscribed its handlers yet
	// readyz check failed
}

// notStarted stands for a *message.Router whose Run has not been called.
type notStarted struct{}

func (notStarted) IsRunning() bool { return false }
func (notStarted) IsClosed() bool  { return false }
