package amqp

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"strings"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/internal/redact"
)

// connectError says why connecting to url (taken from urlFrom, see
// transport.Config.Setting) failed and what to check; a refusal that
// waiting cannot fix is marked failure.Permanent.
func connectError(url, urlFrom string, err error) error {
	host := redact.URL(url)
	var (
		amqpErr   *amqp091.Error
		record    tls.RecordHeaderError
		unknownCA x509.UnknownAuthorityError
		hostname  x509.HostnameError
		invalid   x509.CertificateInvalidError
		verify    *tls.CertificateVerificationError
	)
	switch {
	case errors.Is(err, amqp091.ErrCredentials), errors.As(err, &amqpErr) && amqpErr.Code == amqp091.AccessRefused:
		return failure.Permanent(fmt.Errorf("amqp: %s refused the user and password of the URL (from %s): %w (fix them in %s, or grant the user access)", host, urlFrom, err, urlFrom))
	case errors.As(err, &amqpErr) && amqpErr.Code == amqp091.NotAllowed && (strings.Contains(amqpErr.Reason, "limit") || strings.Contains(amqpErr.Reason, "is down")):
		// A vhost's connection limit reached, or the vhost restarting:
		// waiting can fix both.
		return fmt.Errorf("amqp: %s refused the connection for now (URL from %s): %w", host, urlFrom, err)
	case errors.Is(err, amqp091.ErrVhost), errors.As(err, &amqpErr) && amqpErr.Code == amqp091.NotAllowed:
		return failure.Permanent(fmt.Errorf("amqp: %s refused the URL's vhost (from %s): %w (create it, grant the user access, or fix the path of %s)", host, urlFrom, err, urlFrom))
	case errors.Is(err, amqp091.ErrSASL):
		return failure.Permanent(fmt.Errorf("amqp: %s offers no authentication mechanism this client speaks (URL from %s): %w", host, urlFrom, err))
	case errors.As(err, &record):
		return failure.Permanent(fmt.Errorf("amqp: %s did not answer the TLS handshake with TLS (URL from %s): %w: the port speaks plaintext AMQP (a listener mismatch): use amqp:// for it, or the broker's TLS port (5671) with amqps://", host, urlFrom, err))
	case errors.As(err, &unknownCA), errors.As(err, &hostname), errors.As(err, &invalid), errors.As(err, &verify):
		return failure.Permanent(fmt.Errorf("amqp: %s: its TLS certificate is not trusted (URL from %s): %w (set amqp.Config.TLS with the CA that signed it)", host, urlFrom, err))
	}
	return fmt.Errorf("amqp: cannot connect to %s: %w (check %s and that RabbitMQ is up)", host, err, urlFrom)
}
