package dlq

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// Defaults of Config's zero fields.
const (
	DefaultStream        = "CURFEW_DLQ"
	DefaultSubjectPrefix = "curfew.dlq"
	DefaultMaxAge        = 14 * 24 * time.Hour
	DefaultDuplicates    = 2 * time.Minute
	// DefaultPublishTimeout bounds one publish; the store already holds the dead letter.
	DefaultPublishTimeout = 5 * time.Second
)

// Config configures a JetStream publisher.
type Config struct {
	Stream         string
	SubjectPrefix  string
	MaxAge         time.Duration
	Duplicates     time.Duration
	PublishTimeout time.Duration
}

func (c Config) withDefaults() Config {
	if c.Stream == "" {
		c.Stream = DefaultStream
	}
	if c.SubjectPrefix == "" {
		c.SubjectPrefix = DefaultSubjectPrefix
	}
	if c.MaxAge == 0 {
		c.MaxAge = DefaultMaxAge
	}
	if c.Duplicates == 0 {
		c.Duplicates = DefaultDuplicates
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	return c
}

// Message is a dead letter as published: the store's record, JSON-encoded.
type Message struct {
	ID             string    `json:"id"`
	Tenant         string    `json:"tenant"`
	RunID          string    `json:"run_id"`
	Step           string    `json:"step"`
	ErrorType      string    `json:"error_type"`
	Attempts       int       `json:"attempts"`
	LastError      string    `json:"last_error"`
	Payload        []byte    `json:"payload,omitempty"`
	IdempotencyKey string    `json:"idempotency_key,omitempty"`
	Timestamp      time.Time `json:"timestamp"`
	ReplayCount    int       `json:"replay_count,omitempty"`
}

// MessageOf converts a stored dead letter.
func MessageOf(d store.DeadLetter) Message {
	return Message{ID: d.ID, Tenant: d.Tenant, RunID: d.RunID, Step: d.Step, ErrorType: d.ErrorType, Attempts: d.Attempts,
		LastError: d.LastError, Payload: d.Payload, IdempotencyKey: d.IdempotencyKey, Timestamp: d.CreatedAt, ReplayCount: d.ReplayCount}
}

// JetStream publishes dead letters to a NATS JetStream stream.
type JetStream struct {
	cfg Config
	js  jetstream.JetStream
}

// NewJetStream ensures the stream exists (creating it, or updating its subjects and
// limits) and returns a publisher on nc.
func NewJetStream(ctx context.Context, nc *nats.Conn, cfg Config) (*JetStream, error) {
	cfg = cfg.withDefaults()
	if strings.ContainsAny(cfg.SubjectPrefix, " *>") || strings.HasSuffix(cfg.SubjectPrefix, ".") {
		return nil, fmt.Errorf("dlq: subject prefix %q must be a literal subject", cfg.SubjectPrefix)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("dlq: jetstream: %w", err)
	}
	_, err = js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name:        cfg.Stream,
		Description: "curfew dead letters: steps and runs that failed for good",
		Subjects:    []string{cfg.SubjectPrefix + ".>"},
		Storage:     jetstream.FileStorage,
		MaxAge:      cfg.MaxAge,
		Duplicates:  cfg.Duplicates,
	})
	if err != nil {
		return nil, fmt.Errorf("dlq: stream %s: %w", cfg.Stream, err)
	}
	return &JetStream{cfg: cfg, js: js}, nil
}

// Subject is the subject a tenant's dead letters are published on.
func (p *JetStream) Subject(tenant string) string {
	return p.cfg.SubjectPrefix + "." + subjectToken(tenant)
}

// Stream is the stream's name.
func (p *JetStream) Stream() string { return p.cfg.Stream }

// Publish publishes d and waits for the stream's acknowledgement. Publishing the same
// dead letter (same ID and replay count) again within the duplicate window stores nothing
// new.
func (p *JetStream) Publish(ctx context.Context, d store.DeadLetter) error {
	b, err := json.Marshal(MessageOf(d))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.PublishTimeout)
	defer cancel()
	msgID := fmt.Sprintf("%s/%d", d.ID, d.ReplayCount)
	if _, err := p.js.Publish(ctx, p.Subject(d.Tenant), b, jetstream.WithMsgID(msgID)); err != nil {
		return fmt.Errorf("dlq: publish %s: %w", d.ID, err)
	}
	return nil
}

// subjectToken makes a tenant name one literal subject token.
func subjectToken(s string) string {
	if s == "" {
		return "_"
	}
	return strings.Map(func(r rune) rune {
		if r == '.' || r == '*' || r == '>' || r <= ' ' || r == 0x7f {
			return '_'
		}
		return r
	}, s)
}

// Publisher publishes dead letters; JetStream is the implementation.
type Publisher interface {
	Publish(ctx context.Context, d store.DeadLetter) error
}

// Recorder records dead letters in the store and, when Publisher is set, publishes the
// ones it added.
type Recorder struct {
	Store     store.DeadLetters
	Publisher Publisher // nil: the store only
	Log       *slog.Logger
}

// Record adds d. added is false when an open dead letter for the same tenant, run and
// step already existed (it is returned, and not published again). A publish failure is
// logged and returned wrapped in ErrNotPublished, with the stored dead letter: the store
// is the record, and the caller may go on.
func (r *Recorder) Record(ctx context.Context, d store.DeadLetter) (store.DeadLetter, bool, error) {
	dl, added, err := r.Store.AddDeadLetter(ctx, d)
	if err != nil || !added || r.Publisher == nil {
		return dl, added, err
	}
	if err := r.Publisher.Publish(ctx, dl); err != nil {
		if r.Log != nil {
			r.Log.WarnContext(ctx, "dead letter stored but not published", "run_id", dl.RunID, "step", dl.Step, "dead_letter_id", dl.ID, "error", err.Error())
		}
		return dl, true, fmt.Errorf("%w: %w", ErrNotPublished, err)
	}
	return dl, true, nil
}

// ErrNotPublished marks a dead letter that is in the store but could not be published.
var ErrNotPublished = errors.New("dead letter stored, not published")

// DepthCollector exports curfew_dlq_depth: the open (not replayed) dead letters of all
// tenants, read from the store at scrape time within timeout.
func DepthCollector(s store.DeadLetters, timeout time.Duration) prometheus.Collector {
	return &depthCollector{s: s, timeout: timeout,
		desc: prometheus.NewDesc("curfew_dlq_depth", "Dead letters not yet replayed, across tenants, read from the store when scraped.", nil, nil)}
}

type depthCollector struct {
	s       store.DeadLetters
	timeout time.Duration
	desc    *prometheus.Desc
}

func (c *depthCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *depthCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout) //nolint:contextcheck // a scrape has no caller context
	defer cancel()
	n, err := c.s.DeadLetterDepth(ctx, "")
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n))
}
