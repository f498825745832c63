package retry

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"time"
)

// File is the retry section of a service's configuration file (JSON):
//
//	{"naive": false,
//	 "default": {"max_attempts": 3, "base": "25ms", "cap": "250ms", "min_attempt_time": "10ms"},
//	 "budget": {"ratio": 0.2, "per_second": 10, "window": "10s"},
//	 "throttle": false,
//	 "window": {"replicas": 1, "length": "10s"},
//	 "targets": {"toolrunner": {"default": {...},
//	                            "methods": {"/curfew.toolrunner.v1.ToolRunnerService/Execute": {"max_attempts": 2}}}}}
//
// A target's default and method policies start from the file's default; fields they set
// override it. {"disabled": true} turns retries off. "window" sets the cluster-wide
// retry windows (WindowConfig), used only by a service whose store is shared.
type File struct {
	// Naive turns every policy naive (see Policy.Naive) and the budget off: the retry storm
	// curfew prevents, for comparison benchmarks only.
	Naive    bool                  `json:"naive"`
	Default  PolicyJSON            `json:"default"`
	Budget   BudgetJSON            `json:"budget"`
	Throttle bool                  `json:"throttle"`
	Window   WindowJSON            `json:"window"`
	Targets  map[string]TargetJSON `json:"targets"`
}

// WindowJSON is a WindowConfig in the file; unset fields take the defaults.
type WindowJSON struct {
	Disabled bool      `json:"disabled"`
	Replicas *int      `json:"replicas"`
	Length   *Duration `json:"length"`
}

// Defaults of the cluster-wide retry windows (issue 24, seed 001).
const (
	// DefaultWindowReplicas is how many replicas may retry calls to one target at a time.
	DefaultWindowReplicas = 1
	// DefaultWindowLength is how long a replica's retry window lasts once claimed.
	DefaultWindowLength = 10 * time.Second
)

// WindowConfig says how retries are coordinated across the replicas that share a store
// (mesh/retrywindow): per target, at most Replicas replicas may retry during a window of
// Length; the others fail their calls at the first error, as if their retries were spent.
type WindowConfig struct {
	// Off: every replica retries on its own (a private store always means Off).
	Off bool
	// Replicas is the number of windows per target (default DefaultWindowReplicas).
	Replicas int
	// Length is how long a window lasts from its claim (default DefaultWindowLength).
	Length time.Duration
}

// Validate checks the window's bounds.
func (w WindowConfig) Validate() error {
	if w.Off {
		return nil
	}
	if w.Replicas < 1 || w.Replicas > 1000 {
		return errorf("window.replicas %d: want 1 to 1000", w.Replicas)
	}
	if w.Length < 100*time.Millisecond || w.Length > time.Hour {
		return errorf("window.length %v: want 100ms to 1h", w.Length)
	}
	return nil
}

// RetryWindow returns the file's window configuration, defaults applied. The naive baseline
// has none.
func (f *File) RetryWindow() WindowConfig {
	w := WindowConfig{Off: f.Window.Disabled || f.Naive, Replicas: DefaultWindowReplicas, Length: DefaultWindowLength}
	if f.Window.Replicas != nil {
		w.Replicas = *f.Window.Replicas
	}
	if f.Window.Length != nil {
		w.Length = time.Duration(*f.Window.Length)
	}
	return w
}

// TargetJSON is one target's policies.
type TargetJSON struct {
	Default *PolicyJSON           `json:"default"`
	Methods map[string]PolicyJSON `json:"methods"`
}

// PolicyJSON is a Policy in the file; unset fields inherit.
type PolicyJSON struct {
	Disabled       *bool     `json:"disabled"`
	MaxAttempts    *int      `json:"max_attempts"`
	Base           *Duration `json:"base"`
	Cap            *Duration `json:"cap"`
	MinAttemptTime *Duration `json:"min_attempt_time"`
	NonIdempotent  *bool     `json:"non_idempotent"`
}

// BudgetJSON is a BudgetConfig in the file.
type BudgetJSON struct {
	Disabled  bool     `json:"disabled"`
	Ratio     *float64 `json:"ratio"`
	PerSecond *float64 `json:"per_second"`
	Window    Duration `json:"window"`
}

// Duration is a time.Duration written as a string ("250ms").
type Duration time.Duration

// UnmarshalJSON parses "250ms".
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("a duration is a string such as \"250ms\": %w", err)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// LoadFile reads and validates a retry configuration file.
func LoadFile(path string) (*File, error) {
	b, err := os.ReadFile(path) //nolint:gosec // the operator names the file (--retry-config)
	if err != nil {
		return nil, err
	}
	f, err := DecodeFile(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return f, nil
}

// DecodeFile decodes and validates the content of a retry configuration file. Unknown
// fields are an error.
func DecodeFile(b []byte) (*File, error) {
	var f File
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&f); err != nil {
		return nil, err
	}
	if err := f.Validate(); err != nil {
		return nil, err
	}
	return &f, nil
}

// Validate checks every policy the file can produce.
func (f *File) Validate() error {
	if err := f.Default.Apply(Policy{}).Validate(); err != nil {
		return fmt.Errorf("default: %w", err)
	}
	for name := range f.Targets {
		if err := f.For(name).Validate(); err != nil {
			return fmt.Errorf("targets.%s: %w", name, err)
		}
	}
	if err := f.RetryWindow().Validate(); err != nil {
		return err
	}
	return f.budget().Validate()
}

// Apply returns base with the fields p sets.
func (p PolicyJSON) Apply(base Policy) Policy {
	if p.Disabled != nil {
		base.Disabled = *p.Disabled
	}
	if p.MaxAttempts != nil {
		base.MaxAttempts = *p.MaxAttempts
	}
	if p.Base != nil {
		base.Base = time.Duration(*p.Base)
	}
	if p.Cap != nil {
		base.Cap = time.Duration(*p.Cap)
	}
	if p.MinAttemptTime != nil {
		base.MinAttemptTime = time.Duration(*p.MinAttemptTime)
	}
	if p.NonIdempotent != nil {
		base.NonIdempotent = *p.NonIdempotent
	}
	return base
}

func (f *File) budget() BudgetConfig {
	// Unset fields take the defaults here, so that an explicit 0 stays 0.
	b := BudgetConfig{Disabled: f.Budget.Disabled || f.Naive, Window: time.Duration(f.Budget.Window),
		Ratio: DefaultBudgetRatio, PerSecond: DefaultBudgetPerSecond}
	if f.Budget.Ratio != nil {
		b.Ratio = *f.Budget.Ratio
	}
	if f.Budget.PerSecond != nil {
		b.PerSecond = *f.Budget.PerSecond
	}
	return b
}

// For returns the Config of the connection to target (Target, Metrics and Logger are the
// caller's to set).
func (f *File) For(target string) Config {
	def := f.Default.Apply(Policy{Naive: f.Naive})
	cfg := Config{Target: target, Budget: f.budget(), Throttle: f.Throttle, Default: def}
	t, ok := f.Targets[target]
	if !ok {
		return cfg
	}
	if t.Default != nil {
		cfg.Default = t.Default.Apply(def)
	}
	if len(t.Methods) > 0 {
		cfg.Methods = make(map[string]Policy, len(t.Methods))
		for m, p := range t.Methods {
			cfg.Methods[m] = p.Apply(cfg.Default)
		}
	}
	return cfg
}
