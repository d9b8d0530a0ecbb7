package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"strings"
	"syscall"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"

	"github.com/millwright/millwright/failure"
)

// settings names where a transport.Config field's value came from
// (transport.Config.Setting), for the error messages of Open.
type settings func(field string) string

// fieldSettings names the fields of Config, for Open called directly.
func fieldSettings(field string) string { return "kafka.Config." + strings.TrimPrefix(field, "Kafka.") }

// open is Open with the settings' sources: transport.Open passes
// transport.Config.Setting, so that errors name the variable or URL the
// user set.
func open(ctx context.Context, cfg Config, logger watermill.LoggerAdapter, setting settings) (_ *Transport, err error) {
	if cfg.Fake && cfg.Version == "" {
		cfg.Version = KfakeVersion
	}
	setDefaults(&cfg)
	if err := validate(cfg); err != nil {
		return nil, failure.Permanent(err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	var stopFake func()
	if cfg.Fake {
		cfg.Brokers, stopFake, err = (*loadFake())()
		if err != nil {
			return nil, failure.Permanent(fmt.Errorf("kafka: starting the in-process development fake (kfake): %w", err))
		}
		defer func() {
			if err != nil {
				stopFake()
			}
		}()
		logger.Info("DEVELOPMENT FAKE: in-process Kafka (kfake), in memory, not for production", watermill.LogFields{"brokers": strings.Join(cfg.Brokers, ",")})
	}
	sc, err := saramaConfig(cfg)
	if err != nil {
		return nil, failure.Permanent(err)
	}

	type result struct {
		c   sarama.Client
		p   sarama.SyncProducer
		err error
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.ConnectTimeout)
	defer cancel()
	ch := make(chan result, 1)
	go func() {
		c, err := sarama.NewClient(cfg.Brokers, sc)
		if err != nil {
			ch <- result{err: connectError(cfg, sc, setting, err)}
			return
		}
		p, err := sarama.NewSyncProducerFromClient(c)
		if err != nil {
			_ = c.Close()
			err = fmt.Errorf("kafka: creating the producer on brokers %s: %w", strings.Join(cfg.Brokers, ","), err)
		}
		ch <- result{c, p, err}
	}()
	var r result
	select {
	case r = <-ch:
		if r.err != nil {
			return nil, r.err
		}
	case <-ctx.Done():
		go func() { // the dial finishes on its own; release what it made
			if r := <-ch; r.err == nil {
				_ = r.p.Close()
				_ = r.c.Close()
			}
		}()
		return nil, fmt.Errorf("kafka: brokers %s (from %s) did not answer within %s (ConnectTimeout; check %s and that the cluster is up): %w",
			strings.Join(cfg.Brokers, ","), setting("Kafka.Brokers"), cfg.ConnectTimeout, setting("Kafka.Brokers"), ctx.Err())
	}

	return &Transport{
		cfg:      cfg,
		stopFake: stopFake,
		logger:   logger,
		pub: &Publisher{
			client: r.c, producer: r.p, marshaler: Marshaler{}, logger: logger,
			topicWait: sc.Admin.Timeout,
		},
	}, nil
}

// connectError explains why sarama.NewClient failed. Sarama reports a
// broker that closed the connection during the TLS or SASL handshake,
// as a listener of another protocol does, only as "client has run out of
// available brokers to talk to" (the broker's own error goes to its
// logger): so each bootstrap broker is asked again, alone, to learn what
// it said. Refusals that waiting cannot fix are marked failure.Permanent.
func connectError(cfg Config, sc *sarama.Config, setting settings, err error) error {
	brokers := strings.Join(cfg.Brokers, ",")
	from := setting("Kafka.Brokers")
	if errors.Is(err, sarama.ErrSASLAuthenticationFailed) {
		return failure.Permanent(credentialsRefused(cfg, brokers, from, setting, err))
	}
	if errors.Is(err, sarama.ErrOutOfBrokers) && !cfg.Fake {
		for _, addr := range cfg.Brokers {
			if d := diagnose(cfg, sc, setting, addr); d != nil {
				return d
			}
		}
	}
	return fmt.Errorf("kafka: cannot reach brokers %s (from %s): %w (check %s and that the cluster is up)", brokers, from, err, from)
}

func credentialsRefused(cfg Config, brokers, from string, setting settings, err error) error {
	return fmt.Errorf("kafka: brokers %s (from %s) refused the SASL %s credentials of user %q (from %s): %w (fix the user and password, or the mechanism the broker enables)",
		brokers, from, strings.ToUpper(cfg.SASL.Mechanism), cfg.SASL.User, setting("Kafka.SASL"), err)
}

// diagnose connects to addr alone and returns an error saying why the
// broker would not talk, or nil if nothing explains it.
func diagnose(cfg Config, sc *sarama.Config, setting settings, addr string) error {
	err := probe(sc, addr)
	if err == nil {
		return nil
	}
	from := setting("Kafka.Brokers")
	tlsOn, saslOn := sc.Net.TLS.Enable, sc.Net.SASL.Enable
	mech := strings.ToUpper(cfg.SASL.Mechanism)
	var (
		unknownCA x509.UnknownAuthorityError
		hostname  x509.HostnameError
		invalid   x509.CertificateInvalidError
		verify    *tls.CertificateVerificationError
		record    tls.RecordHeaderError
	)
	switch {
	case tlsOn && (errors.As(err, &unknownCA) || errors.As(err, &hostname) || errors.As(err, &invalid) || errors.As(err, &verify)):
		return failure.Permanent(fmt.Errorf("kafka: broker %s (from %s): its TLS certificate is not trusted: %w (set the CA that signed it: MILLWRIGHT_KAFKA_TLS_CA_FILE, or ca_file= in the kafka:// URL; TLS from %s)",
			addr, from, err, setting("Kafka.TLS")))
	case tlsOn && (errors.As(err, &record) || closed(err)):
		mismatch := fmt.Errorf("kafka: broker %s (from %s) closed the connection during the TLS handshake: %w; TLS is on (from %s), but the listener at that address does not speak TLS",
			addr, from, err, setting("Kafka.TLS"))
		if probe(plain(sc), addr) == nil {
			// It answers plaintext Kafka: a PLAINTEXT (or SASL_PLAINTEXT) listener.
			return failure.Permanent(fmt.Errorf("%w: it answers plaintext Kafka, so it is a PLAINTEXT or SASL_PLAINTEXT listener (a listener mismatch): point %s at the broker's SSL or SASL_SSL listener, or turn TLS off", mismatch, from))
		}
		return fmt.Errorf("%w (a listener mismatch?): point %s at the broker's SSL or SASL_SSL listener, or turn TLS off", mismatch, from)
	case saslOn && errors.Is(err, sarama.ErrSASLAuthenticationFailed):
		return failure.Permanent(credentialsRefused(cfg, addr, from, setting, err))
	case saslOn && errors.Is(err, sarama.ErrIllegalSASLState):
		return failure.Permanent(fmt.Errorf("kafka: broker %s (from %s) refused the SASL handshake: %w; SASL %s is on (from %s), but the listener at that address does not take SASL: it is a PLAINTEXT or SSL listener (a listener mismatch): point %s at the broker's SASL_PLAINTEXT or SASL_SSL listener, or turn SASL off",
			addr, from, err, mech, setting("Kafka.SASL"), from))
	case saslOn && errors.Is(err, sarama.ErrUnsupportedSASLMechanism):
		return failure.Permanent(fmt.Errorf("kafka: broker %s (from %s) does not enable SASL mechanism %s (from %s): %w (use one its listener enables)",
			addr, from, mech, setting("Kafka.SASL"), err))
	case saslOn && closed(err):
		return fmt.Errorf("kafka: broker %s (from %s) closed the connection during the SASL handshake: %w; SASL %s is on (from %s): the listener at that address may not take SASL over plaintext (an SSL or SASL_SSL listener needs TLS too; a listener mismatch): check %s and the broker's listeners",
			addr, from, err, mech, setting("Kafka.SASL"), from)
	case closed(err):
		return fmt.Errorf("kafka: broker %s (from %s) closed the connection before answering: %w; a broker that is stopping does that, and so does a listener that requires TLS or SASL (SSL, SASL_PLAINTEXT or SASL_SSL: a listener mismatch): check %s and the broker's listeners",
			addr, from, err, from)
	}
	return nil
}

// closed reports an error of a connection the other end closed.
func closed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// plain is sc without TLS and SASL.
func plain(sc *sarama.Config) *sarama.Config {
	c := *sc
	c.Net.TLS.Enable, c.Net.TLS.Config = false, nil
	c.Net.SASL.Enable = false
	return &c
}

// probe opens one connection to addr with sc (TLS and SASL handshakes
// included) and asks the broker's API versions: nil if it answers.
func probe(sc *sarama.Config, addr string) error {
	b := sarama.NewBroker(addr)
	if err := b.Open(sc); err != nil {
		return err
	}
	defer func() { _ = b.Close() }()
	if _, err := b.Connected(); err != nil { // waits for the handshakes
		return err
	}
	_, err := b.ApiVersions(&sarama.ApiVersionsRequest{})
	return err
}
