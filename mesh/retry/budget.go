package retry

import (
	"sync"
	"time"
)

// Defaults of BudgetConfig's zero fields (Linkerd/Finagle).
const (
	DefaultBudgetRatio     = 0.2
	DefaultBudgetPerSecond = 10
	DefaultBudgetWindow    = 10 * time.Second
)

// BudgetConfig caps retries per client and target: within the sliding Window, retries may
// number at most Ratio × requests + PerSecond × Window seconds.
type BudgetConfig struct {
	Disabled  bool
	Ratio     float64
	PerSecond float64
	Window    time.Duration
}

// WithDefaults returns c with zero fields defaulted. Ratio and PerSecond default together,
// only when both are zero: a config that sets one of them takes the other as given, so
// {Ratio: 0.2} has no per-second floor.
func (c BudgetConfig) WithDefaults() BudgetConfig {
	if c.Ratio == 0 && c.PerSecond == 0 {
		c.Ratio = DefaultBudgetRatio
		c.PerSecond = DefaultBudgetPerSecond
	}
	if c.Window == 0 {
		c.Window = DefaultBudgetWindow
	}
	return c
}

// Validate reports a budget outside its bounds.
func (c BudgetConfig) Validate() error {
	if c.Ratio < 0 || c.Ratio > 10 || c.PerSecond < 0 || c.Window < 0 {
		return errorf("budget: ratio must be in [0, 10], per_second and window not negative")
	}
	return nil
}

// window counts events in one-second buckets over a sliding window.
type window struct {
	size    int
	buckets []bucket
}

type bucket struct {
	sec             int64
	requests, other int64
}

func newWindow(d time.Duration) *window {
	n := int(d / time.Second)
	if n < 1 {
		n = 1
	}
	return &window{size: n, buckets: make([]bucket, n)}
}

func (w *window) at(now time.Time) *bucket {
	s := now.Unix()
	b := &w.buckets[int(s%int64(w.size))]
	if b.sec != s {
		*b = bucket{sec: s}
	}
	return b
}

func (w *window) sums(now time.Time) (requests, other int64) {
	s := now.Unix()
	for _, b := range w.buckets {
		if s-b.sec < int64(w.size) {
			requests += b.requests
			other += b.other
		}
	}
	return requests, other
}

// Budget is a retry budget for one client and target. It is safe for concurrent use.
type Budget struct {
	cfg BudgetConfig
	now func() time.Time
	mu  sync.Mutex
	w   *window
}

// NewBudget returns a budget; now is the clock (time.Now when nil).
func NewBudget(cfg BudgetConfig, now func() time.Time) *Budget {
	cfg = cfg.WithDefaults()
	if now == nil {
		now = time.Now
	}
	return &Budget{cfg: cfg, now: now, w: newWindow(cfg.Window)}
}

// Request records a logical call (its first attempt).
func (b *Budget) Request() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.w.at(b.now()).requests++
}

// AllowRetry reports whether one more retry fits the budget, and records it if it does.
func (b *Budget) AllowRetry() bool {
	if b.cfg.Disabled {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	req, ret := b.w.sums(now)
	limit := b.cfg.Ratio*float64(req) + b.cfg.PerSecond*b.cfg.Window.Seconds()
	if float64(ret)+1 > limit {
		return false
	}
	b.w.at(now).other++
	return true
}

// Throttle is client-side adaptive throttling (SRE book): a request is rejected locally
// with probability max(0, (requests − K·accepts)/(requests + 1)) over the window.
type Throttle struct {
	K   float64
	now func() time.Time
	mu  sync.Mutex
	w   *window
}

// DefaultThrottleK is the SRE book's multiplier.
const DefaultThrottleK = 2

// NewThrottle returns a throttle over window (DefaultBudgetWindow when 0) with multiplier k
// (DefaultThrottleK when 0).
func NewThrottle(k float64, window time.Duration, now func() time.Time) *Throttle {
	if k == 0 {
		k = DefaultThrottleK
	}
	if window == 0 {
		window = DefaultBudgetWindow
	}
	if now == nil {
		now = time.Now
	}
	return &Throttle{K: k, now: now, w: newWindow(window)}
}

// Allow decides a request with rnd in [0, 1) and records it.
func (t *Throttle) Allow(rnd float64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	req, acc := t.w.sums(now)
	p := (float64(req) - t.K*float64(acc)) / (float64(req) + 1)
	t.w.at(now).requests++
	return rnd >= p
}

// Accepted records that the backend accepted a request (it answered with anything but a
// sign of overload).
func (t *Throttle) Accepted() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.w.at(t.now()).other++
}
