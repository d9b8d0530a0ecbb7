// Command payments is a payments service on millwright's client: a payment
// and its event written in one transaction (the outbox), a key-parallel
// consumer with idempotency and park starting a saga per payment (reserve
// funds, charge, notify; a refused charge releases the funds), poison to the
// dead-letter table, the console, metrics and health. On pgx, on whichever
// transport MILLWRIGHT_TRANSPORT names (unset: sql on the database):
//
//	go run ./examples/payments demo   # or serve: POST /payments, /console/ ($MILLWRIGHT_CONSOLE_PASSWORD), /metrics, /readyz
//	payments=40 settled=31 failed=8 dead_letters=1 lost=0 doubled=0
package main

import (
	"cmp"
	"context"
	"embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/millwright/millwright"
	"github.com/millwright/millwright/console"
	"github.com/millwright/millwright/dlq"
	"github.com/millwright/millwright/failure"
	"github.com/millwright/millwright/metadata"
	"github.com/millwright/millwright/migrate"
	"github.com/millwright/millwright/outbox"
	"github.com/millwright/millwright/postgres"
	"github.com/millwright/millwright/saga"
	_ "github.com/millwright/millwright/transport/all" // configuration chooses among every kind
)

//go:embed migrations/*.sql
var schema embed.FS

// Payment is the submitted event's payload and the saga's data.
type Payment struct {
	ID      string `json:"id"`
	Account string `json:"account"`
	Amount  int64  `json:"amount"`
}

const limit = 1000 // the most one payment may charge: above, the charge is refused

type service struct {
	*millwright.Client
	db   postgres.DB
	name string
	saga *saga.Orchestrator[Payment]
}

func (s *service) topic(t string) string { return s.name + "." + t }

// newService registers what the service does; Run starts it.
func newService(db postgres.DB, cfg millwright.Config) (*service, error) {
	cfg.Migrate, cfg.Migrations = true, []migrate.Source{migrate.Embedded("payments", schema, "migrations")}
	c, err := millwright.NewClient(db, cfg)
	if err != nil {
		return nil, err
	}
	s := &service{Client: c, db: db, name: cfg.Name}
	to := func(topic string) func(Payment) (saga.Command, error) {
		return func(p Payment) (saga.Command, error) { return saga.Command{Topic: s.topic(topic), Payload: p}, nil }
	}
	def := saga.MustDefine("payment",
		saga.Step[Payment]{Name: "reserve_funds", Command: to("funds"), Compensation: to("funds")},
		saga.Step[Payment]{Name: "charge", Command: to("charges"), Compensation: to("charges")},
		saga.Step[Payment]{Name: "notify", Command: to("notifications"), NoCompensation: true})
	s.saga, err = millwright.AddSaga(c, def, saga.Config{ReplyTopic: s.topic("replies")})
	return s, errors.Join(err,
		c.Handle("start", s.topic("submitted"), s.start, millwright.HandlerConfig{}),
		c.Participant("funds", s.topic("funds"), s.funds, millwright.HandlerConfig{}),
		c.Participant("charges", s.topic("charges"), s.charges, millwright.HandlerConfig{}),
		c.Participant("notifications", s.topic("notifications"), s.notify, millwright.HandlerConfig{}))
}

// submit writes the payment and its event in one transaction. The event's
// aggregate is the account: one account's payments are handled in order,
// different accounts' in parallel.
func (s *service) submit(ctx context.Context, p Payment) error {
	body, _ := json.Marshal(p) // a Payment always marshals
	return s.db.InTx(ctx, func(tx postgres.Tx) error {
		if err := exec(ctx, tx, `INSERT INTO payments (id, account, amount) VALUES ($1, $2, $3)`, p.ID, p.Account, p.Amount); err != nil {
			return err
		}
		return s.Add(ctx, tx, outbox.Event{Topic: s.topic("submitted"), AggregateType: "account", AggregateID: p.Account,
			EventType: "payment.submitted.v1", Payload: body})
	})
}

// start begins a payment's saga; one that can never be paid is poison (dead-lettered, its account held).
func (s *service) start(ctx context.Context, tx postgres.Tx, msg *message.Message) error {
	p, err := decode(msg)
	if err != nil {
		return err
	}
	if p.Amount <= 0 {
		return failure.Permanent(fmt.Errorf("payment %s: amount %d is not positive", p.ID, p.Amount))
	}
	return s.saga.Start(ctx, tx, p.ID, p)
}

func (s *service) funds(ctx context.Context, tx postgres.Tx, cmd *message.Message) (any, error) {
	p, err := decode(cmd)
	if err != nil || compensating(cmd) {
		return nil, errors.Join(err, exec(ctx, tx, `UPDATE payments_holds SET released = true WHERE payment_id = $1`, p.ID),
			exec(ctx, tx, `UPDATE payments SET state = 'failed' WHERE id = $1`, p.ID))
	}
	return nil, exec(ctx, tx, `INSERT INTO payments_holds (payment_id, account, amount) VALUES ($1, $2, $3)`, p.ID, p.Account, p.Amount)
}

func (s *service) charges(ctx context.Context, tx postgres.Tx, cmd *message.Message) (any, error) {
	p, err := decode(cmd)
	switch {
	case err != nil || compensating(cmd):
		return nil, errors.Join(err, exec(ctx, tx, `UPDATE payments_charges SET refunded = true WHERE payment_id = $1`, p.ID))
	case p.Amount > limit:
		return nil, millwright.Refuse(fmt.Sprintf("amount %d is over the limit of %d", p.Amount, limit))
	}
	return nil, exec(ctx, tx, `INSERT INTO payments_charges (payment_id, amount) VALUES ($1, $2)`, p.ID, p.Amount)
}

func (s *service) notify(ctx context.Context, tx postgres.Tx, cmd *message.Message) (any, error) {
	p, err := decode(cmd)
	return nil, errors.Join(err, exec(ctx, tx, `INSERT INTO payments_notifications (payment_id) VALUES ($1)`, p.ID),
		exec(ctx, tx, `UPDATE payments SET state = 'settled' WHERE id = $1`, p.ID))
}

func decode(cmd *message.Message) (p Payment, err error) { return p, dlq.DecodeJSON(cmd, &p) }

func compensating(cmd *message.Message) bool {
	return cmd.Metadata.Get(metadata.SagaPhase) == saga.PhaseCompensation
}

func exec(ctx context.Context, tx postgres.Tx, sql string, args ...any) error {
	_, err := tx.Pgx().Exec(ctx, sql, args...)
	return err
}

// demo submits n payments and prints the counts once each is settled, failed or dead.
func demo(ctx context.Context, s *service, n int, out io.Writer) error {
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx) }()
	select {
	case <-s.Running():
	case err := <-errc:
		return err
	}
	for i := range n {
		p := Payment{ID: fmt.Sprintf("p%04d", i), Account: fmt.Sprintf("acct-%d", i%7), Amount: int64(100 + i)}
		if i == 0 {
			p.Account, p.Amount = "acct-poison", 0 // poison: dead-lettered
		} else if i%5 == 4 {
			p.Amount = 5 * limit // refused: compensated
		}
		if err := s.submit(ctx, p); err != nil {
			return errors.Join(err, s.Close())
		}
	}
	var settled, failed, dead, doubled int
	var err error
	for ; settled+failed+dead < n && err == nil; time.Sleep(100 * time.Millisecond) {
		err = s.db.Pgx().QueryRow(ctx, `SELECT (SELECT count(*) FROM payments WHERE state = 'settled'),
			(SELECT count(*) FROM payments WHERE state = 'failed'), (SELECT count(*) FROM millwright_dead_letters),
			(SELECT count(*) - count(DISTINCT payment_id) FROM payments_holds) + (SELECT count(*) - count(DISTINCT payment_id) FROM payments_charges)
			+ (SELECT count(*) - count(DISTINCT payment_id) FROM payments_notifications)`).Scan(&settled, &failed, &dead, &doubled)
	}
	if err := errors.Join(err, s.Close(), <-errc); err != nil {
		return err
	}
	fmt.Fprintf(out, "payments=%d settled=%d failed=%d dead_letters=%d lost=%d doubled=%d\n", n, settled, failed, dead, n-settled-failed-dead, doubled)
	return ctx.Err()
}

// serve runs the service with its HTTP API until SIGINT or SIGTERM.
func serve(ctx context.Context, s *service, listen string) error {
	ops, err := console.New(s.db, console.Config{BasePath: "/console", Authenticate: operator})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/", s.Handler()) // /healthz, /readyz, /metrics
	mux.Handle("/console/", ops)
	mux.HandleFunc("POST /payments", func(w http.ResponseWriter, r *http.Request) {
		var p Payment
		if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&p); err != nil || p.ID == "" || p.Account == "" {
			http.Error(w, `want {"id":"…","account":"…","amount":n}`, http.StatusBadRequest)
		} else if err := s.submit(r.Context(), p); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
		} else {
			w.WriteHeader(http.StatusAccepted)
		}
	})
	srv := &http.Server{Addr: listen, Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second}
	go func() { _ = srv.ListenAndServe() }()
	defer srv.Close()
	return s.Run(ctx)
}

// operator authenticates the console's users: any name, with the password
// in $MILLWRIGHT_CONSOLE_PASSWORD (none set: nobody).
func operator(w http.ResponseWriter, r *http.Request) (string, bool) {
	user, pass, ok := r.BasicAuth()
	if want := os.Getenv("MILLWRIGHT_CONSOLE_PASSWORD"); !ok || want == "" || pass != want {
		w.Header().Set("WWW-Authenticate", `Basic realm="payments console"`)
		http.Error(w, "unauthorized", http.StatusUnauthorized)
		return "", false
	}
	return user, true
}

func main() {
	url := flag.String("database-url", cmp.Or(os.Getenv("MILLWRIGHT_DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "Postgres URL of the service database")
	name := flag.String("name", "payments", "service name: prefixes its topics and consumer groups")
	listen := flag.String("listen", "127.0.0.1:8080", "serve: HTTP address")
	n := flag.Int("payments", 40, "demo: payments to submit")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, flag.Arg(0), *url, *name, *listen, *n); err != nil {
		fmt.Fprintln(os.Stderr, "payments:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, mode, url, name, listen string, n int) error {
	pool, err := postgres.OpenPgx(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	s, err := newService(postgres.Pgx(pool), millwright.Config{Name: name, DatabaseURL: url})
	switch {
	case err != nil:
		return err
	case mode == "demo":
		return demo(ctx, s, n, os.Stdout)
	case mode == "serve" || mode == "":
		return serve(ctx, s, listen)
	}
	return fmt.Errorf("unknown command %q: want serve or demo", mode)
}
