package admission

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"time"
)

// Defaults of Config's zero fields.
const (
	// DefaultService is the service label of curfew_shed_total.
	DefaultService = "orchestrator"
	// DefaultMaxQueue is a pool's queue depth limit when PoolConfig.MaxQueue is 0.
	DefaultMaxQueue = 1024
	// DefaultMaxQueueAge is a pool's queue age limit when PoolConfig.MaxQueueAge is 0. It
	// is the backup shed: deadline slack is the primary one, so it is generous.
	DefaultMaxQueueAge = 30 * time.Second
	// DefaultCancelGrace is the seed's CANCEL_GRACE_S: the time a run needs, on top of its
	// expected service time, to be cancelled cleanly before its deadline.
	DefaultCancelGrace = time.Second
	// DefaultFailClosedWindow is how long the overflow pool stays closed after the last
	// occurrence of a fail-closed condition.
	DefaultFailClosedWindow = time.Minute
	// DefaultRetryAfter is the RetryInfo delay of sheds with no better estimate
	// (queue_full, queue_age, tenant_concurrency, shutdown).
	DefaultRetryAfter = time.Second
	// DefaultBudgetWindow is a tenant's token budget window when TenantLimits.Window is 0.
	DefaultBudgetWindow = time.Hour
)

// MinRetryAfter is the least RetryInfo delay of a shed, so that a refused caller is never
// invited back in the same instant (the retry layer's backoff base, Envoy's 25 ms).
const MinRetryAfter = 25 * time.Millisecond

// Config configures a Controller. The zero values of its optional fields are the
// Default* constants; Pools is required. [DefaultConfig] is the seed's drill.
type Config struct {
	// Service is the service label of curfew_shed_total; "" means DefaultService.
	Service string
	// Pools are the admission pools. The first takes critical work and must not be the
	// overflow pool; at most one pool is marked Overflow, and it takes sheddable work.
	Pools []PoolConfig
	// CancelGrace is added to a run's expected service time in the deadline slack rule
	// (shed when expected + CancelGrace > slack); 0 means DefaultCancelGrace.
	CancelGrace time.Duration
	// FailClosedWindow keeps the overflow pool closed for this long after the last
	// occurrence of each fail-closed condition; 0 means DefaultFailClosedWindow.
	FailClosedWindow time.Duration
	// RetryAfter is the RetryInfo delay of queue_full, queue_age, tenant_concurrency and
	// shutdown sheds; 0 means DefaultRetryAfter.
	RetryAfter time.Duration
	// DefaultTenant is the limits of a tenant without an entry in Tenants. Its zero value
	// is no limit.
	DefaultTenant TenantLimits
	// Tenants are per-tenant limits by tenant id. An entry replaces DefaultTenant as a
	// whole (a zero field of the entry is "no limit", not "the default's value").
	Tenants map[string]TenantLimits

	// Now is the clock; nil means time.Now. Tests inject one. Queue-age and slack timers of
	// queued requests still run on real time, measured from Now's readings.
	Now func() time.Time
	// Limits, when set, is asked for a tenant's limits instead of DefaultTenant and
	// Tenants: the seam for budgets kept in the store. It is called with the controller's
	// lock held and must not block (a store-backed source answers from a cache).
	Limits LimitSource
	// Cluster, when its Slots is set, claims every admission in the store so that pool
	// caps and tenant concurrency hold across replicas (docs/cluster.md).
	Cluster ClusterConfig
}

// PoolConfig configures one pool.
type PoolConfig struct {
	// Name names the pool in Request.Pool, errors and metric labels:
	// [a-z0-9][a-z0-9_-]*, at most 32 characters, unique.
	Name string
	// MaxInFlight is the most runs the pool runs at once (its leases); at least 1.
	MaxInFlight int
	// MaxQueue is the most runs waiting for the pool; 0 means DefaultMaxQueue.
	MaxQueue int
	// MaxQueueAge is the longest a run waits in the queue before it is shed with
	// queue_age; 0 means DefaultMaxQueueAge.
	MaxQueueAge time.Duration
	// Overflow marks the optional-capacity pool: sheddable work goes there, and it fails
	// closed while the cancel path is not proven.
	Overflow bool
	// SlackShed says whether the deadline-slack rule sheds this pool's requests. nil
	// means the default: true for the overflow pool, false for the others. The seed sheds
	// overflow work on slack; hard-deadline work on a paid pool runs until its deadline,
	// and each hop still fails it fast when too little time is left to start.
	SlackShed *bool
}

// TenantLimits are one tenant's limits. Zero fields are no limit.
type TenantLimits struct {
	// MaxInFlight is the most runs of the tenant admitted or queued at once, across all
	// pools; 0 is unlimited.
	MaxInFlight int
	// TokenBudget is the most tokens the tenant may spend (settled) plus reserve (admitted
	// or queued runs' ExpectedTokens) per Window; 0 is unlimited.
	TokenBudget int64
	// Window is the budget's fixed window, aligned to the Unix epoch (an hour window runs
	// from hh:00 to hh+1:00 UTC); 0 means DefaultBudgetWindow.
	Window time.Duration
	// Rate is the most runs per second the tenant may start (a token bucket, refilled at
	// Rate and holding Burst); 0 is unlimited. A run over it is shed with rate_limited and
	// a RetryInfo delay of when the next token arrives.
	Rate float64
	// Burst is the bucket's size; 0 means max(1, ⌈Rate⌉).
	Burst int
	// RequestRate is the most calls per second the tenant may make to the orchestrator's
	// public API, runs' starts, reads (GetRun, ListRuns, WatchRun), cancels and dead
	// letters alike (a token bucket, refilled at RequestRate and holding RequestBurst); 0 is
	// unlimited. A call over it is refused with request_rate_limited and a RetryInfo delay
	// of when the next token arrives. Rate still bounds run starts within it.
	RequestRate float64
	// RequestBurst is the request bucket's size; 0 means max(1, ⌈RequestRate⌉).
	RequestBurst int
	// MaxDeadline is the longest deadline (time left at arrival) a run of the tenant may
	// ask for; 0 is no limit beyond the service's --max-deadline. A longer one is refused
	// (OUT_OF_RANGE) before anything starts: the caller asked for more time than its
	// tenant is granted, which a silent cap would hide.
	MaxDeadline time.Duration
	// ApproverNotStarter makes an approval gate of the tenant's runs (docs/operations.md,
	// "Approval gates") refuse a decision by whoever started the run (PERMISSION_DENIED):
	// four eyes on an irreversible effect. false: anyone with the admin scope decides.
	ApproverNotStarter bool
}

// burst is the bucket size of l's rate.
func (l TenantLimits) burst() float64 {
	if l.Burst > 0 {
		return float64(l.Burst)
	}
	return max(1, math.Ceil(l.Rate))
}

// requestBurst is the bucket size of l's request rate.
func (l TenantLimits) requestBurst() float64 {
	if l.RequestBurst > 0 {
		return float64(l.RequestBurst)
	}
	return max(1, math.Ceil(l.RequestRate))
}

// LimitSource tells a Controller a tenant's limits. Config implements it from
// DefaultTenant and Tenants; the store will be another source.
type LimitSource interface {
	TenantLimits(tenant string) TenantLimits
}

// TenantLimits returns the limits of tenant from Tenants or DefaultTenant, with the
// budget window defaulted.
func (c Config) TenantLimits(tenant string) TenantLimits {
	l, ok := c.Tenants[tenant]
	if !ok {
		l = c.DefaultTenant
	}
	if l.Window == 0 {
		l.Window = DefaultBudgetWindow
	}
	return l
}

// DefaultConfig is the seed's drill: pools paid (2 in flight, for critical work) and
// overflow (8 in flight, sheddable work, fails closed), generous queue limits
// (DefaultMaxQueue deep, DefaultMaxQueueAge old), a 1 s cancel grace, a 1 min fail-closed
// window, and no tenant limits or budgets.
func DefaultConfig() Config {
	return Config{
		Service: DefaultService,
		Pools: []PoolConfig{
			{Name: "paid", MaxInFlight: 2, MaxQueue: DefaultMaxQueue, MaxQueueAge: DefaultMaxQueueAge},
			{Name: "overflow", MaxInFlight: 8, MaxQueue: DefaultMaxQueue, MaxQueueAge: DefaultMaxQueueAge, Overflow: true},
		},
		CancelGrace:      DefaultCancelGrace,
		FailClosedWindow: DefaultFailClosedWindow,
		RetryAfter:       DefaultRetryAfter,
	}
}

// WithDefaults returns c with its zero fields set to the defaults. Pools is copied, so
// the caller's slice is not changed. It is idempotent.
func (c Config) WithDefaults() Config {
	if c.Service == "" {
		c.Service = DefaultService
	}
	if c.CancelGrace == 0 {
		c.CancelGrace = DefaultCancelGrace
	}
	if c.FailClosedWindow == 0 {
		c.FailClosedWindow = DefaultFailClosedWindow
	}
	if c.RetryAfter == 0 {
		c.RetryAfter = DefaultRetryAfter
	}
	c.Cluster = c.Cluster.withDefaults()
	pools := make([]PoolConfig, len(c.Pools))
	for i, p := range c.Pools {
		if p.MaxQueue == 0 {
			p.MaxQueue = DefaultMaxQueue
		}
		if p.MaxQueueAge == 0 {
			p.MaxQueueAge = DefaultMaxQueueAge
		}
		if p.SlackShed == nil {
			v := p.Overflow
			p.SlackShed = &v
		}
		pools[i] = p
	}
	c.Pools = pools
	return c
}

// ConfigError is a validation error: which field is wrong and why. Field is the field's
// path in the JSON file ("pools[1].max_in_flight").
type ConfigError struct {
	Field  string
	Value  any
	Reason string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("admission: %s %v: %s", e.Field, e.Value, e.Reason)
}

var poolName = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,31}$`)

// Validate reports the first field of c (defaults applied) outside its bounds, as a
// *ConfigError.
func (c Config) Validate() error {
	d := c.WithDefaults()
	switch {
	case len(d.Pools) == 0:
		return &ConfigError{"pools", "[]", "at least one pool is required"}
	case d.CancelGrace < 0:
		return &ConfigError{"cancel_grace", d.CancelGrace, "must not be negative"}
	case d.FailClosedWindow < 0:
		return &ConfigError{"fail_closed_window", d.FailClosedWindow, "must not be negative"}
	case d.RetryAfter < 0:
		return &ConfigError{"retry_after", d.RetryAfter, "must not be negative"}
	}
	if err := d.Cluster.validate(); err != nil {
		return err
	}
	seen := map[string]int{}
	overflow := -1
	for i, p := range d.Pools {
		f := func(name string) string { return fmt.Sprintf("pools[%d].%s", i, name) }
		if !poolName.MatchString(p.Name) {
			return &ConfigError{f("name"), fmt.Sprintf("%q", p.Name), "must match [a-z0-9][a-z0-9_-]* and be at most 32 characters"}
		}
		if j, dup := seen[p.Name]; dup {
			return &ConfigError{f("name"), fmt.Sprintf("%q", p.Name), fmt.Sprintf("duplicate of pools[%d]", j)}
		}
		seen[p.Name] = i
		switch {
		case p.MaxInFlight < 1:
			return &ConfigError{f("max_in_flight"), p.MaxInFlight, "must be at least 1"}
		case p.MaxQueue < 1:
			return &ConfigError{f("max_queue"), c.Pools[i].MaxQueue, "must be at least 1 (0: the default)"}
		case p.MaxQueueAge < 0:
			return &ConfigError{f("max_queue_age"), p.MaxQueueAge, "must not be negative"}
		}
		if p.Overflow {
			if overflow >= 0 {
				return &ConfigError{f("overflow"), true, fmt.Sprintf("pools[%d] is already the overflow pool; at most one", overflow)}
			}
			if i == 0 {
				return &ConfigError{f("overflow"), true, "the first pool takes critical work and cannot be the overflow pool"}
			}
			overflow = i
		}
	}
	if err := d.DefaultTenant.validate("default_tenant"); err != nil {
		return err
	}
	for name, l := range d.Tenants {
		if name == "" {
			return &ConfigError{"tenants", `""`, "a tenant id must not be empty"}
		}
		if err := l.validate(fmt.Sprintf("tenants[%q]", name)); err != nil {
			return err
		}
	}
	return nil
}

func (l TenantLimits) validate(field string) error {
	switch {
	case l.MaxInFlight < 0:
		return &ConfigError{field + ".max_in_flight", l.MaxInFlight, "must not be negative (0: unlimited)"}
	case l.TokenBudget < 0:
		return &ConfigError{field + ".token_budget", l.TokenBudget, "must not be negative (0: unlimited)"}
	case l.Window < 0:
		return &ConfigError{field + ".window", l.Window, "must not be negative (0: the default)"}
	case l.Rate < 0 || math.IsNaN(l.Rate) || math.IsInf(l.Rate, 0):
		return &ConfigError{field + ".rate", l.Rate, "must be a finite number, not negative (0: unlimited)"}
	case l.Burst < 0:
		return &ConfigError{field + ".burst", l.Burst, "must not be negative (0: the rate rounded up)"}
	case l.RequestRate < 0 || math.IsNaN(l.RequestRate) || math.IsInf(l.RequestRate, 0):
		return &ConfigError{field + ".request_rate", l.RequestRate, "must be a finite number, not negative (0: unlimited)"}
	case l.RequestBurst < 0:
		return &ConfigError{field + ".request_burst", l.RequestBurst, "must not be negative (0: the request rate rounded up)"}
	case l.MaxDeadline < 0:
		return &ConfigError{field + ".max_deadline", l.MaxDeadline, "must not be negative (0: no tenant limit)"}
	}
	return nil
}

// The JSON file's shape: Config with durations as strings and snake_case names.
type fileConfig struct {
	Service          string                `json:"service"`
	Pools            []filePool            `json:"pools"`
	CancelGrace      duration              `json:"cancel_grace"`
	FailClosedWindow duration              `json:"fail_closed_window"`
	RetryAfter       duration              `json:"retry_after"`
	DefaultTenant    fileTenant            `json:"default_tenant"`
	Tenants          map[string]fileTenant `json:"tenants"`
}

type filePool struct {
	Name        string   `json:"name"`
	MaxInFlight int      `json:"max_in_flight"`
	MaxQueue    int      `json:"max_queue"`
	MaxQueueAge duration `json:"max_queue_age"`
	Overflow    bool     `json:"overflow"`
	SlackShed   *bool    `json:"slack_shed"`
}

type fileTenant struct {
	MaxInFlight  int      `json:"max_in_flight"`
	TokenBudget  int64    `json:"token_budget"`
	Window       duration `json:"window"`
	Rate         float64  `json:"rate"`
	Burst        int      `json:"burst"`
	RequestRate  float64  `json:"request_rate"`
	RequestBurst int      `json:"request_burst"`
	MaxDeadline  duration `json:"max_deadline"`
	// ApproverNotStarter: see TenantLimits.
	ApproverNotStarter bool `json:"approver_not_starter"`
}

func (t fileTenant) limits() TenantLimits {
	return TenantLimits{MaxInFlight: t.MaxInFlight, TokenBudget: t.TokenBudget, Window: time.Duration(t.Window),
		Rate: t.Rate, Burst: t.Burst, RequestRate: t.RequestRate, RequestBurst: t.RequestBurst, MaxDeadline: time.Duration(t.MaxDeadline),
		ApproverNotStarter: t.ApproverNotStarter}
}

// duration is a time.Duration written as a string ("12s").
type duration time.Duration

func (d *duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("a duration is a string such as \"12s\", got %s", b)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = duration(v)
	return nil
}

// Load reads, decodes and validates the JSON config file at path. See [Decode].
func Load(path string) (Config, error) {
	b, err := os.ReadFile(path) //nolint:gosec // the operator names the file (--admission-config)
	if err != nil {
		return Config{}, fmt.Errorf("admission: %w", err)
	}
	cfg, err := Decode(bytes.NewReader(b))
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// Decode decodes and validates one JSON config document from r. Decoding is strict: an
// unknown field, a duration that is not a string, or data after the document is an
// error. Omitted fields take the defaults (Config.WithDefaults); the result has them
// applied.
func Decode(r io.Reader) (Config, error) {
	dec := json.NewDecoder(r)
	dec.DisallowUnknownFields()
	var f fileConfig
	if err := dec.Decode(&f); err != nil {
		return Config{}, fmt.Errorf("admission: decoding config: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return Config{}, errors.New("admission: decoding config: data after the JSON document")
	}
	cfg := Config{
		Service:          f.Service,
		CancelGrace:      time.Duration(f.CancelGrace),
		FailClosedWindow: time.Duration(f.FailClosedWindow),
		RetryAfter:       time.Duration(f.RetryAfter),
		DefaultTenant:    f.DefaultTenant.limits(),
	}
	for _, p := range f.Pools {
		cfg.Pools = append(cfg.Pools, PoolConfig{Name: p.Name, MaxInFlight: p.MaxInFlight, MaxQueue: p.MaxQueue,
			MaxQueueAge: time.Duration(p.MaxQueueAge), Overflow: p.Overflow, SlackShed: p.SlackShed})
	}
	if f.Tenants != nil {
		cfg.Tenants = make(map[string]TenantLimits, len(f.Tenants))
		for name, t := range f.Tenants {
			cfg.Tenants[name] = t.limits()
		}
	}
	if err := cfg.Validate(); err != nil {
		return Config{}, err
	}
	return cfg.WithDefaults(), nil
}
