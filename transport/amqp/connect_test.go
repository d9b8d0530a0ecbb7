package amqp_test

import (
	"context"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/transport"
	"github.com/millwright/millwright/transport/transporttest"
)

// closedAddr returns a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// A RabbitMQ URL given as MILLWRIGHT_TRANSPORT, to a port nothing listens
// on: the error tells to check MILLWRIGHT_TRANSPORT, where the URL came
// from, not MILLWRIGHT_AMQP_URL, and hides the password.
func TestConnectErrorNamesMillwrightTransport(t *testing.T) {
	t.Setenv(transport.EnvTransport, "amqp://guest:hunter2@"+closedAddr(t)+"/")
	t.Setenv(transport.EnvWaitForBroker, "off")
	cfg, err := transport.FromEnv()
	require.NoError(t, err)
	_, err = transport.Open(context.Background(), cfg)
	require.Error(t, err)
	t.Log(err)
	require.Contains(t, err.Error(), "check "+transport.EnvTransport)
	require.NotContains(t, err.Error(), transport.EnvAMQPURL)
	require.NotContains(t, err.Error(), "hunter2")
}

// Given as MILLWRIGHT_AMQP_URL, it is that variable the error names.
func TestConnectErrorNamesMillwrightAMQPURL(t *testing.T) {
	t.Setenv(transport.EnvTransport, "amqp")
	t.Setenv(transport.EnvAMQPURL, "amqp://guest:hunter2@"+closedAddr(t)+"/")
	t.Setenv(transport.EnvWaitForBroker, "off")
	cfg, err := transport.FromEnv()
	require.NoError(t, err)
	_, err = transport.Open(context.Background(), cfg)
	require.Error(t, err)
	require.Contains(t, err.Error(), "check "+transport.EnvAMQPURL)
	require.NotContains(t, err.Error(), "hunter2")
}

// Credentials RabbitMQ refuses are permanent: Open returns at once, with
// the default wait for the broker on, naming where the URL came from.
func TestRefusedCredentialsAreNotWaitedFor(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(transporttest.AMQPURL())
	require.NoError(t, err)
	u.User = url.UserPassword("millwright_nobody", "hunter2")
	cfg := transport.Config{Kind: transport.AMQP}
	cfg.AMQP.URL = u.String()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = transport.Open(ctx, cfg)
	require.Error(t, err)
	t.Log(err)
	require.True(t, failure.IsPermanent(err), "%v", err)
	require.NotErrorIs(t, err, transport.ErrGaveUpWaiting)
	require.Contains(t, err.Error(), "refused the user and password")
	require.Contains(t, err.Error(), "Config.AMQP.URL")
	require.NotContains(t, err.Error(), "hunter2")
}
