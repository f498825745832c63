package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// Defaults of Config's zero fields.
const (
	DefaultStream        = "CURFEW_OUTBOX"
	DefaultSubjectPrefix = "curfew.outbox"
	DefaultBatch         = 100
	DefaultInterval      = 250 * time.Millisecond
	DefaultLeaseTTL      = 10 * time.Second
	// DefaultDuplicates is the duplicate window of a stream the relay creates. Exactly
	// once does not depend on it; it only spares a compare after a lost acknowledgement.
	DefaultDuplicates     = 2 * time.Minute
	DefaultPublishTimeout = 5 * time.Second
)

// Headers of a relayed message besides Nats-Msg-Id.
const (
	HeaderTenant     = "Curfew-Tenant"
	HeaderChannel    = "Curfew-Channel"
	HeaderChannelSeq = "Curfew-Channel-Seq" // the row's position on its channel: 1, 2, ... without gaps
	HeaderKey        = "Curfew-Idempotency-Key"
)

// Config configures a Relay.
type Config struct {
	Stream        string // DefaultStream
	SubjectPrefix string // DefaultSubjectPrefix
	// Duplicates is the duplicate window of the stream when the relay creates it
	// (DefaultDuplicates). An existing stream is used as it is.
	Duplicates time.Duration
	Batch      int           // rows read per batch (DefaultBatch)
	Interval   time.Duration // pause after a batch that drained the outbox, and between claims (DefaultInterval)
	// Rate caps publishes per second, to spare the stream's consumers a burst after
	// an outage; 0: no cap.
	Rate           float64
	LeaseTTL       time.Duration // the relay lease (DefaultLeaseTTL), renewed every third of it
	PublishTimeout time.Duration // DefaultPublishTimeout
	Owner          string        // this process incarnation in the lease; required
	Log            *slog.Logger  // nil: slog.Default()
	// Registerer receives the relay's metrics (nil: none): curfew_outbox_relayed_total,
	// curfew_outbox_relay_errors_total, curfew_outbox_relay_leader.
	Registerer prometheus.Registerer
}

func (c Config) withDefaults() Config {
	if c.Stream == "" {
		c.Stream = DefaultStream
	}
	if c.SubjectPrefix == "" {
		c.SubjectPrefix = DefaultSubjectPrefix
	}
	if c.Duplicates == 0 {
		c.Duplicates = DefaultDuplicates
	}
	if c.Batch <= 0 {
		c.Batch = DefaultBatch
	}
	if c.Interval <= 0 {
		c.Interval = DefaultInterval
	}
	if c.LeaseTTL <= 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.PublishTimeout <= 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.Log == nil {
		c.Log = slog.Default()
	}
	return c
}

// Outcomes of a relayed row (the outcome label of curfew_outbox_relayed_total).
const (
	// OutcomePublished: the stream stored the message now.
	OutcomePublished = "published"
	// OutcomeDuplicate: a publish again after a lost acknowledgement, within the
	// stream's duplicate window; the server stored nothing.
	OutcomeDuplicate = "duplicate"
	// OutcomeFound: the stream refused the publish (the subject's last sequence had
	// moved) and its last message was this row's: published before a crash, after the
	// duplicate window.
	OutcomeFound = "found"
)

// Outcomes lists every outcome, for metrics known in advance.
var Outcomes = []string{OutcomePublished, OutcomeDuplicate, OutcomeFound}

// ErrForeign says a subject's last message is neither the row being relayed nor the last
// one the cursor recorded (someone else publishes there, or the stream lost messages).
// The relay stops relaying that channel rather than risk a duplicate or a gap.
var ErrForeign = errors.New("outbox: the subject's last message is not the relay's")

// Relay publishes the outbox to JetStream while it holds the relay lease.
type Relay struct {
	cfg    Config
	st     store.Outbox
	js     jetstream.JetStream
	stream jetstream.Stream
	m      metrics
	sleep  func(ctx context.Context, d time.Duration) bool
}

type metrics struct {
	relayed *prometheus.CounterVec
	errors  prometheus.Counter
	leader  prometheus.Gauge
}

// New ensures the stream exists (it creates a missing one, covering <prefix>.>, and
// leaves an existing one as it is) and returns a relay of st on nc.
func New(ctx context.Context, nc *nats.Conn, st store.Outbox, cfg Config) (*Relay, error) {
	cfg = cfg.withDefaults()
	if cfg.Owner == "" {
		return nil, errors.New("outbox: the relay needs an owner")
	}
	if strings.ContainsAny(cfg.SubjectPrefix, " *>") || strings.HasSuffix(cfg.SubjectPrefix, ".") || cfg.SubjectPrefix == "" {
		return nil, fmt.Errorf("outbox: subject prefix %q must be a literal subject", cfg.SubjectPrefix)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("outbox: jetstream: %w", err)
	}
	stream, err := js.Stream(ctx, cfg.Stream)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		stream, err = js.CreateStream(ctx, jetstream.StreamConfig{
			Name:        cfg.Stream,
			Description: "curfew outbox: notify messages, one subject per tenant and channel",
			Subjects:    []string{cfg.SubjectPrefix + ".>"},
			Storage:     jetstream.FileStorage,
			Duplicates:  cfg.Duplicates,
		})
	}
	if err != nil {
		return nil, fmt.Errorf("outbox: stream %s: %w", cfg.Stream, err)
	}
	r := &Relay{cfg: cfg, st: st, js: js, stream: stream, m: newMetrics(cfg.Registerer), sleep: sleep}
	return r, nil
}

func newMetrics(reg prometheus.Registerer) metrics {
	m := metrics{
		relayed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "curfew_outbox_relayed_total",
			Help: "Outbox rows relayed to JetStream, by outcome: published, duplicate (caught by the stream's duplicate window), found (already on the stream after a crash)."}, []string{"outcome"}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "curfew_outbox_relay_errors_total",
			Help: "Failed attempts to relay an outbox row (publish, store, or a subject whose last message is not the relay's); the row is tried again."}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{Name: "curfew_outbox_relay_leader",
			Help: "1 while this replica holds the outbox relay lease, else 0."}),
	}
	for _, o := range Outcomes {
		m.relayed.WithLabelValues(o)
	}
	if reg != nil {
		reg.MustRegister(m.relayed, m.errors, m.leader)
	}
	return m
}

// Subject is the subject of a tenant's channel: <prefix>.<tenant>.<channel>, each
// escaped into one literal token ([Token]).
func Subject(prefix, tenant, channel string) string {
	return prefix + "." + Token(tenant) + "." + Token(channel)
}

// Token escapes s into one literal subject token, injectively: letters, digits, '-'
// and '_' stay, every other byte becomes %XX (so "a.b" is "a%2Eb").
func Token(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' {
			b.WriteByte(c)
			continue
		}
		fmt.Fprintf(&b, "%%%02X", c)
	}
	return b.String()
}

// MsgID is a row's Nats-Msg-Id: its key, tenant/idempotency-key/index-in-call.
func MsgID(e store.OutboxEntry) string {
	return e.Tenant + "/" + e.IdempotencyKey + "/" + strconv.Itoa(e.Seq)
}

// Run relays until ctx ends: it claims the lease when it is free, renews it while held,
// relays batch after batch, and releases it on the way out.
func (r *Relay) Run(ctx context.Context) {
	var (
		held    bool
		l       store.RelayLease
		renewed time.Time
	)
	defer func() {
		r.m.leader.Set(0)
		if held {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			_ = r.st.ReleaseOutboxRelay(rctx, l)
		}
	}()
	for ctx.Err() == nil {
		var err error
		if !held {
			l, err = r.st.ClaimOutboxRelay(ctx, r.cfg.Owner, r.cfg.LeaseTTL)
			if err != nil {
				if !errors.Is(err, store.ErrLeaseHeld) && ctx.Err() == nil {
					r.cfg.Log.Warn("outbox relay: claim", "error", err.Error())
				}
				r.sleep(ctx, r.cfg.Interval)
				continue
			}
			held, renewed = true, time.Now()
			r.m.leader.Set(1)
			r.cfg.Log.Info("outbox relay: lease claimed", "epoch", l.Epoch)
		}
		renew := func() bool {
			if time.Since(renewed) < r.cfg.LeaseTTL/3 {
				return true
			}
			nl, err := r.st.HeartbeatOutboxRelay(ctx, l, r.cfg.LeaseTTL)
			if err != nil {
				if ctx.Err() == nil {
					r.cfg.Log.Warn("outbox relay: lease lost", "epoch", l.Epoch, "error", err.Error())
				}
				if errors.Is(err, store.ErrStaleEpoch) || time.Since(renewed) >= r.cfg.LeaseTTL {
					held = false
					r.m.leader.Set(0)
				}
				return false
			}
			l, renewed = nl, time.Now()
			return true
		}
		if !renew() {
			r.sleep(ctx, r.cfg.Interval)
			continue
		}
		n, full := r.batch(ctx, l, renew)
		if !full || n == 0 {
			r.sleep(ctx, r.cfg.Interval)
		}
	}
}

// batch relays one batch of pending rows under l, renewing the lease with renew
// between rows, and returns how many it relayed and whether the batch was full.
func (r *Relay) batch(ctx context.Context, l store.RelayLease, renew func() bool) (int, bool) {
	rows, err := r.st.PendingOutbox(ctx, r.cfg.Batch)
	if err != nil {
		if ctx.Err() == nil {
			r.m.errors.Inc()
			r.cfg.Log.Warn("outbox relay: read pending rows", "error", err.Error())
		}
		return 0, false
	}
	type chKey struct{ tenant, channel string }
	cursors := map[chKey]store.OutboxCursor{}
	blocked := map[chKey]bool{} // a channel that failed waits for the next batch: order first
	n := 0
	for i, p := range rows {
		k := chKey{p.Tenant, p.Channel}
		if blocked[k] || ctx.Err() != nil {
			continue
		}
		if i > 0 && (r.cfg.Rate > 0) {
			r.sleep(ctx, time.Duration(float64(time.Second)/r.cfg.Rate))
		}
		if !renew() {
			return n, false
		}
		cur, ok := cursors[k]
		if !ok {
			cur = p.Cursor
		}
		next, err := r.relay(ctx, l, p.OutboxEntry, cur)
		if err != nil {
			blocked[k] = true
			if ctx.Err() == nil {
				r.m.errors.Inc()
				r.cfg.Log.Warn("outbox relay: row not relayed", "tenant", p.Tenant, "channel", p.Channel,
					"channel_seq", p.ChannelSeq, "id", p.ID, "error", err.Error())
			}
			continue
		}
		cursors[k] = next
		n++
	}
	return n, len(rows) == r.cfg.Batch
}

// relay publishes one row after cur and advances its channel's cursor, returning the
// new cursor.
func (r *Relay) relay(ctx context.Context, l store.RelayLease, e store.OutboxEntry, cur store.OutboxCursor) (store.OutboxCursor, error) {
	subj := Subject(r.cfg.SubjectPrefix, e.Tenant, e.Channel)
	id := MsgID(e)
	seq, outcome, err := r.publish(ctx, subj, id, e, cur)
	if err != nil {
		return cur, err
	}
	adv := store.CursorAdvance{Tenant: e.Tenant, Channel: e.Channel, From: cur.RelayedSeq, To: e.ChannelSeq, StreamSeq: seq, MsgID: id}
	if err := r.st.AdvanceOutbox(ctx, l, adv); err != nil {
		return cur, fmt.Errorf("advance the cursor: %w", err)
	}
	r.m.relayed.WithLabelValues(outcome).Inc()
	return store.OutboxCursor{RelayedSeq: e.ChannelSeq, StreamSeq: seq, MsgID: id, RelayedAt: time.Now()}, nil
}

// publish publishes e on subj expecting cur's stream sequence as the subject's last, and
// returns the stream sequence that holds e. A refusal because the subject moved on is
// settled by the subject's last message: e's (published before, outcome found), or
// cur's at another sequence (publish again expecting it), or ErrForeign.
func (r *Relay) publish(ctx context.Context, subj, id string, e store.OutboxEntry, cur store.OutboxCursor) (uint64, string, error) {
	expect := cur.StreamSeq
	for attempt := 0; attempt < 2; attempt++ {
		msg := nats.NewMsg(subj)
		msg.Data = e.Payload
		msg.Header.Set(HeaderTenant, e.Tenant)
		msg.Header.Set(HeaderChannel, e.Channel)
		msg.Header.Set(HeaderChannelSeq, strconv.FormatInt(e.ChannelSeq, 10))
		msg.Header.Set(HeaderKey, e.IdempotencyKey)
		pctx, cancel := context.WithTimeout(ctx, r.cfg.PublishTimeout)
		ack, err := r.js.PublishMsg(pctx, msg, jetstream.WithMsgID(id), jetstream.WithExpectLastSequencePerSubject(expect))
		cancel()
		if err == nil {
			if ack.Duplicate {
				return ack.Sequence, OutcomeDuplicate, nil
			}
			return ack.Sequence, OutcomePublished, nil
		}
		var apiErr *jetstream.APIError
		if !errors.As(err, &apiErr) || (apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequence &&
			apiErr.ErrorCode != jetstream.JSErrCodeStreamWrongLastSequenceConstant) {
			return 0, "", fmt.Errorf("publish %s on %s: %w", id, subj, err)
		}
		last, err := r.stream.GetLastMsgForSubject(ctx, subj)
		if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
			return 0, "", fmt.Errorf("read the last message on %s: %w", subj, err)
		}
		var lastID string
		var lastSeq uint64
		if last != nil {
			lastID, lastSeq = last.Header.Get(jetstream.MsgIDHeader), last.Sequence
		}
		switch {
		case last != nil && lastID == id:
			return lastSeq, OutcomeFound, nil
		case last != nil && cur.MsgID != "" && lastID == cur.MsgID && lastSeq != expect:
			expect = lastSeq // the cursor's message, moved (the stream was restored): this row is not there
			continue
		}
		return 0, "", fmt.Errorf("%w: %s holds %q at sequence %d; the cursor expects %q at %d", ErrForeign, subj, lastID, lastSeq, cur.MsgID, cur.StreamSeq)
	}
	return 0, "", fmt.Errorf("%w: %s moved twice while publishing %s", ErrForeign, subj, id)
}

// sleep waits d or until ctx ends, and reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// LagCollector exports curfew_outbox_lag: the rows not yet relayed, across tenants, read
// from the store at scrape time within timeout.
func LagCollector(s store.Outbox, timeout time.Duration) prometheus.Collector {
	return &lagCollector{s: s, timeout: timeout,
		desc: prometheus.NewDesc("curfew_outbox_lag", "Outbox rows not yet relayed to JetStream, across tenants, read from the store when scraped.", nil, nil)}
}

type lagCollector struct {
	s       store.Outbox
	timeout time.Duration
	desc    *prometheus.Desc
}

func (c *lagCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *lagCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout) //nolint:contextcheck // a scrape has no caller context
	defer cancel()
	n, err := c.s.OutboxLag(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.desc, err)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n))
}
