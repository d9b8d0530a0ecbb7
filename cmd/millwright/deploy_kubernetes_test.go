package main

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/millwright/millwright/cmd/millwright/internal/relayenv"
	"github.com/millwright/millwright/health"
	"github.com/millwright/millwright/transport"
	_ "github.com/millwright/millwright/transport/all" // the manifest selects a kind: millwright relay links every kind
)

type probe struct {
	HTTPGet struct {
		Path string `yaml:"path"`
		Port string `yaml:"port"`
	} `yaml:"httpGet"`
	TimeoutSeconds int `yaml:"timeoutSeconds"`
}

type manifest struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Name string `yaml:"name"`
	} `yaml:"metadata"`
	Spec struct {
		// Deployment
		Template struct {
			Metadata struct {
				Annotations map[string]string `yaml:"annotations"`
			} `yaml:"metadata"`
			Spec struct {
				TerminationGracePeriodSeconds int `yaml:"terminationGracePeriodSeconds"`
				Containers                    []struct {
					Name  string   `yaml:"name"`
					Args  []string `yaml:"args"`
					Ports []struct {
						Name          string `yaml:"name"`
						ContainerPort int    `yaml:"containerPort"`
					} `yaml:"ports"`
					Env []struct {
						Name      string         `yaml:"name"`
						Value     *string        `yaml:"value"`
						ValueFrom map[string]any `yaml:"valueFrom"`
					} `yaml:"env"`
					ReadinessProbe probe `yaml:"readinessProbe"`
					LivenessProbe  probe `yaml:"livenessProbe"`
					StartupProbe   probe `yaml:"startupProbe"`
					Resources      struct {
						Requests map[string]string `yaml:"requests"`
						Limits   map[string]string `yaml:"limits"`
					} `yaml:"resources"`
				} `yaml:"containers"`
			} `yaml:"spec"`
		} `yaml:"template"`
		// Service
		Ports []struct {
			Name       string `yaml:"name"`
			Port       int    `yaml:"port"`
			TargetPort string `yaml:"targetPort"`
		} `yaml:"ports"`
	} `yaml:"spec"`
}

func load(t *testing.T) map[string]manifest {
	t.Helper()
	raw, err := os.ReadFile("../../deploy/kubernetes/relay.yaml")
	require.NoError(t, err)
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	out := map[string]manifest{}
	for {
		var m manifest
		err := dec.Decode(&m)
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err)
		out[m.Kind] = m
	}
	require.Contains(t, out, "Deployment")
	require.Contains(t, out, "Service")
	return out
}

// Every variable the manifest sets is one the relay or its transport reads,
// the required ones are set, and the literal values parse as the relay
// parses them; ports, probe paths and the drain bound match the code.
func TestManifestMatchesTheCode(t *testing.T) {
	ms := load(t)
	dep := ms["Deployment"].Spec.Template.Spec
	require.Len(t, dep.Containers, 1)
	c := dep.Containers[0]
	require.Equal(t, []string{"relay"}, c.Args)

	env := map[string]string{}
	for _, e := range c.Env {
		require.True(t, relayenv.Known(e.Name), "relay.yaml sets %s, which neither millwright relay nor the transport reads (cmd/millwright/internal/relayenv.Vars, TransportVars)", e.Name)
		require.NotContains(t, env, e.Name, "%s set twice", e.Name)
		switch {
		case e.Value != nil:
			env[e.Name] = *e.Value
		case e.ValueFrom != nil:
			env[e.Name] = "postgres://u:p@db:5432/app?search_path=orders" // from a Secret: a stand-in of the documented shape
		default:
			t.Fatalf("%s has neither value nor valueFrom", e.Name)
		}
	}
	for _, required := range []string{relayenv.DatabaseURL, transport.EnvTransport} {
		require.Contains(t, env, required)
	}
	cfg, err := relayenv.Load(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	require.NoError(t, err, "the manifest's values must parse")
	for k, v := range env {
		t.Setenv(k, v) // transport.FromEnv reads the process environment
	}
	tcfg, err := transport.FromEnv()
	require.NoError(t, err)
	require.NoError(t, tcfg.Validate())

	require.Len(t, c.Ports, 1)
	port := c.Ports[0]
	_, addrPort, err := net.SplitHostPort(cfg.Addr)
	require.NoError(t, err)
	require.Equal(t, strconv.Itoa(port.ContainerPort), addrPort, "containerPort and %s", relayenv.Addr)
	require.Equal(t, relayenv.DefaultPort, port.ContainerPort)

	require.Equal(t, health.PathReady, c.ReadinessProbe.HTTPGet.Path)
	require.Equal(t, health.PathLive, c.LivenessProbe.HTTPGet.Path)
	require.Equal(t, health.PathLive, c.StartupProbe.HTTPGet.Path)
	for _, p := range []probe{c.ReadinessProbe, c.LivenessProbe, c.StartupProbe} {
		require.Equal(t, port.Name, p.HTTPGet.Port)
	}
	require.Greater(t, time.Duration(c.ReadinessProbe.TimeoutSeconds)*time.Second, health.DefaultCheckTimeout,
		"the readiness probe must wait longer than the checks' own bound")
	require.Greater(t, time.Duration(dep.TerminationGracePeriodSeconds)*time.Second, cfg.DrainTimeout+time.Second,
		"terminationGracePeriodSeconds must exceed %s, or the kubelet kills a drain", relayenv.DrainTimeout)
	require.NotEmpty(t, c.Resources.Requests["cpu"])
	require.NotEmpty(t, c.Resources.Requests["memory"])
	require.NotEmpty(t, c.Resources.Limits["memory"])

	ann := ms["Deployment"].Spec.Template.Metadata.Annotations
	require.Equal(t, relayenv.PathMetrics, ann["prometheus.io/path"])
	require.Equal(t, strconv.Itoa(port.ContainerPort), ann["prometheus.io/port"])

	svc := ms["Service"].Spec
	require.Len(t, svc.Ports, 1)
	require.Equal(t, port.Name, svc.Ports[0].TargetPort)
	require.Equal(t, port.ContainerPort, svc.Ports[0].Port)
}
