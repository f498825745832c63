package hedge

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// Defaults of Config's zero fields.
const (
	// DefaultWindow is how many recent successful latencies are kept per tool.
	DefaultWindow = 200
	// DefaultMinSamples is how many latencies a tool must have before its calls get
	// backups: at 0.05, 50 samples put 2 or 3 of them above the p95.
	DefaultMinSamples = 50
	// MaxMaxExtraLoad bounds MaxExtraLoad: beyond it a backup is no longer a tail remedy
	// but a second copy of the traffic.
	MaxMaxExtraLoad = 0.5
)

// Config configures a Policy.
type Config struct {
	// MaxExtraLoad is the fraction of calls that may get a backup, from 0 to
	// MaxMaxExtraLoad: a backup is sent after the (1 − MaxExtraLoad) quantile of the
	// tool's recent latencies. 0 turns hedging off (New returns nil).
	MaxExtraLoad float64
	// Window is how many latencies are kept per tool; DefaultWindow when 0.
	Window int
	// MinSamples is how many a tool needs before its calls get backups;
	// DefaultMinSamples when 0. At most Window.
	MinSamples int
	// Metrics, if set, receives the hedging metrics.
	Metrics *Metrics
}

// Validate reports a Config outside its bounds.
func (c Config) Validate() error {
	if math.IsNaN(c.MaxExtraLoad) || c.MaxExtraLoad < 0 || c.MaxExtraLoad > MaxMaxExtraLoad {
		return fmt.Errorf("hedge: max extra load must be from 0 to %v, got %v", MaxMaxExtraLoad, c.MaxExtraLoad)
	}
	if c.Window < 0 || c.MinSamples < 0 {
		return errors.New("hedge: window and min samples must not be negative")
	}
	if w := orDefault(c.Window, DefaultWindow); orDefault(c.MinSamples, DefaultMinSamples) > w {
		return fmt.Errorf("hedge: min samples %d above the window %d", orDefault(c.MinSamples, DefaultMinSamples), w)
	}
	return nil
}

// orDefault returns v, or def when v is 0.
func orDefault(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// Metrics are the hedging metrics, by tool.
type Metrics struct {
	sent, won, refused *prometheus.CounterVec
}

// NewMetrics returns the metrics, registered with reg when it is not nil.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		sent: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "curfew_hedges_sent_total",
			Help: "Hedged backups sent beside a slow tool call, by tool."}, []string{"tool"}),
		won: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "curfew_hedges_won_total",
			Help: "Hedged backups that answered before the call they hedged, by tool."}, []string{"tool"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "curfew_hedges_refused_total",
			Help: "Hedged backups the target's retry budget refused, by tool."}, []string{"tool"}),
	}
	if reg != nil {
		reg.MustRegister(m.sent, m.won, m.refused)
	}
	return m
}

// Policy decides and sends backups. A nil *Policy sends none. It is safe for concurrent
// use.
type Policy struct {
	q          float64 // the quantile: 1 − MaxExtraLoad
	window     int
	minSamples int
	m          *Metrics

	mu    sync.Mutex
	tools map[string]*ring
}

// New returns the Policy of cfg, or nil when cfg.MaxExtraLoad is 0 (hedging off).
func New(cfg Config) (*Policy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.MaxExtraLoad == 0 {
		return nil, nil //nolint:nilnil // a nil Policy is hedging off, and usable
	}
	m := cfg.Metrics
	if m == nil {
		m = NewMetrics(nil)
	}
	return &Policy{q: 1 - cfg.MaxExtraLoad, window: orDefault(cfg.Window, DefaultWindow),
		minSamples: orDefault(cfg.MinSamples, DefaultMinSamples), m: m, tools: map[string]*ring{}}, nil
}

// ring is one tool's recent latencies.
type ring struct {
	d      []time.Duration // at most window, oldest overwritten
	next   int
	sorted []time.Duration // d sorted, nil when d changed since
}

// Observe records a successful call of tool that took d.
func (p *Policy) Observe(tool string, d time.Duration) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.tools[tool]
	if r == nil {
		r = &ring{d: make([]time.Duration, 0, p.window)}
		p.tools[tool] = r
	}
	if len(r.d) < p.window {
		r.d = append(r.d, d)
	} else {
		r.d[r.next] = d
	}
	r.next = (r.next + 1) % p.window
	r.sorted = nil
}

// Delay returns how long a call of tool runs alone before its backup is sent, and false
// when it gets none: hedging off, or fewer than MinSamples latencies of the tool.
func (p *Policy) Delay(tool string) (time.Duration, bool) {
	if p == nil {
		return 0, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.tools[tool]
	if r == nil || len(r.d) < p.minSamples {
		return 0, false
	}
	if r.sorted == nil {
		r.sorted = slices.Clone(r.d)
		slices.Sort(r.sorted)
	}
	// The smallest latency that at least a fraction q of the samples do not exceed.
	i := int(math.Ceil(p.q*float64(len(r.sorted)))) - 1
	return r.sorted[min(max(i, 0), len(r.sorted)-1)], true
}

// Call is one run of a hedged call: backup is false for the first, true for the backup,
// which must be sent with retry.Hedge. ctx is the run's own: cancelled with cause
// cancel.ErrSuperseded when the other answered first.
type Call func(ctx context.Context, backup bool) (string, error)

// outcome is one run's answer.
type outcome struct {
	out    string
	err    error
	backup bool
}

// Do runs call for tool, with a backup when the tool's Delay passes without an answer
// and at least minTime is left before ctx's deadline. The first success wins and the
// other run is cancelled with cause superseded; Do returns once both runs have returned.
// When one run fails the other, if running, is awaited: the call fails only when both
// did, with the first run's error. A nil Policy, or a tool short of its MinSamples,
// runs call once.
func (p *Policy) Do(ctx context.Context, tool string, minTime time.Duration, call Call) (string, error) {
	start := time.Now()
	delay, ok := p.Delay(tool)
	if !ok {
		out, err := call(ctx, false)
		if err == nil {
			p.Observe(tool, time.Since(start))
		}
		return out, err
	}
	results := make(chan outcome, 2)
	run := func(ctx context.Context, backup bool) {
		out, err := call(ctx, backup)
		results <- outcome{out: out, err: err, backup: backup}
	}
	pctx, stopPrimary := context.WithCancelCause(ctx)
	defer stopPrimary(nil)
	bctx, stopBackup := context.WithCancelCause(ctx)
	defer stopBackup(nil)
	go run(pctx, false)
	timer := time.NewTimer(delay)
	defer timer.Stop()

	running := 1
	var failed *outcome // the first run's failure, while the backup may still win
	// settled counts a backup's answer: refused by the budget (nothing was sent), or sent.
	settled := func(o outcome) {
		switch {
		case !o.backup:
		case errors.Is(o.err, retry.ErrHedgeRefused):
			p.m.refused.WithLabelValues(tool).Inc()
		default:
			p.m.sent.WithLabelValues(tool).Inc()
		}
	}
	for {
		select {
		case <-timer.C:
			if deadline.Check(ctx, minTime, "hedge "+tool) == nil {
				running++
				go run(bctx, true)
			}
		case o := <-results:
			running--
			settled(o)
			if o.err == nil {
				took := time.Since(start)
				if o.backup {
					p.m.won.WithLabelValues(tool).Inc()
					stopPrimary(cancel.ErrSuperseded)
					// The primary is only known to be slower than the delay: recorded at
					// the delay, it keeps the quantile where it is. (Its elapsed time,
					// the delay plus the backup's latency, would raise the next delay
					// whenever the quantile falls among such calls, until hedging
					// stopped; leaving it out would lower the quantile, and hedge more
					// than max_extra_load.)
					took = delay
				} else {
					stopBackup(cancel.ErrSuperseded)
				}
				p.Observe(tool, took)
				for ; running > 0; running-- {
					settled(<-results)
				}
				return o.out, nil
			}
			if !o.backup || failed == nil {
				failed = &o // the primary's error wins: it is the call the caller made
			}
			if running == 0 {
				// Every run started has failed (a primary that fails before its delay
				// gets no backup: a failure is the retry layer's to handle).
				return failed.out, failed.err
			}
		}
	}
}
