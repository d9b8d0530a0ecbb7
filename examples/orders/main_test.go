package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/millwright/millwright/internal/pgtest"
)

// The demo prints one summary line counted from the database.
func TestDemo(t *testing.T) {
	t.Parallel()
	schema := pgtest.New(t) // migrations are applied by the demo itself
	var out strings.Builder
	err := demo([]string{"-database-url", pgtest.BaseURL(), "-schema", schema.Name, "-transport", "gochannel",
		"-orders", "12", "-fail-payment-every", "4", "-fail-shipping-every", "5"}, &out)
	require.NoError(t, err)
	// Orders 4, 8 and 12 fail payment, 5 and 10 fail shipping.
	require.Equal(t, "orders=12 completed=7 compensated=5 dlq=1 lost=0 duplicate_effects=0\n", out.String())
}

func TestServeRejectsUnknownService(t *testing.T) {
	t.Parallel()
	err := serve([]string{"billing", "-log", "error", "shipment"})
	require.ErrorContains(t, err, `unknown service "shipment"`)
}
