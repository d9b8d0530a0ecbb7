package amqp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/millwright/millwright/transport/lag"
)

// LagConfig says whose lag a LagReader reads.
type LagConfig struct {
	// Topics and Groups name the queues to read: the queue of each group
	// on each topic (QueueName). Required: at least one topic; Groups
	// default to the topic's own queue ("").
	Topics []string
	Groups []string
	// ManagementURL is RabbitMQ's management API, e.g.
	// http://guest:guest@rabbit:15672, for the queues' unacknowledged
	// messages (AMQP's passive declare reports the ready ones only).
	// Default "": Unacked is -1 (not known). Without credentials in it,
	// the AMQP URL's are used.
	ManagementURL string
	// Client is the HTTP client for ManagementURL. Default: one with a
	// 10s timeout.
	Client *http.Client
}

// LagReader reads RabbitMQ queues' depth: the messages ready (the lag)
// and, with the management API, those delivered and not acknowledged. It
// implements lag.Reader and is safe for concurrent use; each Lag dials
// the broker once (nothing stays open between scrapes).
type LagReader struct {
	cfg   Config
	lc    LagConfig
	vhost string
}

// NewLagReader returns a reader of the queues lc names on cfg's broker.
func NewLagReader(cfg Config, lc LagConfig) (*LagReader, error) {
	setDefaults(&cfg)
	if err := validate(cfg); err != nil {
		return nil, err
	}
	if len(lc.Topics) == 0 {
		return nil, errors.New("amqp: NewLagReader: LagConfig.Topics is empty: name the topics whose consumer queues to read")
	}
	if len(lc.Groups) == 0 {
		lc.Groups = []string{""}
	}
	uri, err := amqp091.ParseURI(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("amqp: NewLagReader: Config.URL: %w", err)
	}
	if lc.ManagementURL != "" {
		mu, err := url.Parse(lc.ManagementURL)
		if err != nil || (mu.Scheme != "http" && mu.Scheme != "https") || mu.Host == "" {
			return nil, fmt.Errorf("amqp: NewLagReader: LagConfig.ManagementURL %q: want http(s)://[user:password@]host:15672", redactURL(lc.ManagementURL))
		}
		if mu.User == nil {
			mu.User = url.UserPassword(uri.Username, uri.Password)
		}
		lc.ManagementURL = strings.TrimRight(mu.String(), "/")
	}
	if lc.Client == nil {
		lc.Client = &http.Client{Timeout: 10 * time.Second}
	}
	return &LagReader{cfg: cfg, lc: lc, vhost: uri.Vhost}, nil
}

func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(unparsable)"
	}
	return u.Redacted()
}

// Lag implements lag.Reader: one row per queue.
func (r *LagReader) Lag(ctx context.Context) ([]lag.Partition, error) {
	conn, err := amqp091.DialConfig(r.cfg.URL, amqp091.Config{TLSClientConfig: r.cfg.TLS, Dial: amqp091.DefaultDial(r.cfg.ConnectTimeout)})
	if err != nil {
		return nil, fmt.Errorf("amqp: dialing %s to read queue depths: %w", redactURL(r.cfg.URL), err)
	}
	defer conn.Close()
	var out []lag.Partition
	var errs []error
	for _, topic := range r.lc.Topics {
		for _, g := range r.lc.Groups {
			if err := ctx.Err(); err != nil {
				return out, err
			}
			q := QueueName(topic, g)
			// A passive declare of a missing queue closes its channel:
			// one channel per queue.
			ch, err := conn.Channel()
			if err != nil {
				errs = append(errs, fmt.Errorf("amqp: opening a channel to read queue %q: %w", q, err))
				continue
			}
			st, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
			_ = ch.Close()
			if err != nil {
				errs = append(errs, fmt.Errorf("amqp: reading queue %q (group %q on topic %q; declared once its consumer subscribed): %w", q, g, topic, err))
				continue
			}
			p := lag.Partition{Transport: "amqp", Group: g, Topic: q, Partition: lag.NoPartition, Committed: -1, End: -1, Lag: int64(st.Messages), Unacked: -1}
			if r.lc.ManagementURL != "" {
				n, err := r.unacked(ctx, q)
				if err != nil {
					errs = append(errs, err)
				} else {
					p.Unacked = n
				}
			}
			out = append(out, p)
		}
	}
	lag.Sort(out)
	return out, errors.Join(errs...)
}

// unacked asks the management API for queue q's unacknowledged messages.
func (r *LagReader) unacked(ctx context.Context, q string) (int64, error) {
	u := r.lc.ManagementURL + "/api/queues/" + url.PathEscape(r.vhost) + "/" + url.PathEscape(q)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return 0, fmt.Errorf("amqp: management API request for queue %q: %w", q, err)
	}
	resp, err := r.lc.Client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("amqp: asking the management API (LagConfig.ManagementURL) about queue %q: %w", q, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("amqp: the management API (LagConfig.ManagementURL) answered %s for queue %q: check the URL, the credentials and the management plugin (rabbitmq-plugins enable rabbitmq_management)", resp.Status, q)
	}
	var body struct {
		Unacked *int64 `json:"messages_unacknowledged"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		return 0, fmt.Errorf("amqp: decoding the management API's answer for queue %q: %w", q, err)
	}
	if body.Unacked == nil {
		// RabbitMQ leaves the counts out until its stats are collected.
		return 0, nil
	}
	return *body.Unacked, nil
}

var _ lag.Reader = (*LagReader)(nil)
