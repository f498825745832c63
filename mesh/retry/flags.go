package retry

import (
	"flag"
	"fmt"
	"time"
)

// The values of --retry-coordination.
const (
	// CoordinationStore: with a store other replicas share, the retries of each target
	// are coordinated in the file's retry windows (File.RetryWindow, docs/cluster.md).
	CoordinationStore = "store"
	// CoordinationOff: every replica retries on its own, as with the file's
	// "window": {"disabled": true}.
	CoordinationOff = "off"
	// DefaultCoordination is --retry-coordination's default.
	DefaultCoordination = CoordinationStore
)

// Flags are the retry flags every service has (--retry-*). A flag given explicitly
// overrides the file's default policy; the file can set per-target and per-method
// policies (see File). Register sets the defaults; a zero Flags means no file and
// MaxAttempts, Base and Cap of zero, which Load's validation refuses.
type Flags struct {
	File        string
	Off         bool
	MaxAttempts int
	Base, Cap   time.Duration
	BudgetRatio float64
	BudgetRPS   float64
	Throttle    bool
	// Coordination is CoordinationStore or CoordinationOff; "" means
	// DefaultCoordination. Off turns the file's retry windows off; store leaves them as
	// the file says.
	Coordination string
}

// Register adds the retry flags to fs, with this package's defaults.
func (r *Flags) Register(fs *flag.FlagSet) {
	fs.StringVar(&r.File, "retry-config", "", "JSON file of retry policies per target and method (see docs/retries.md)")
	fs.BoolVar(&r.Off, "retry-off", false, "make no retries at all")
	fs.IntVar(&r.MaxAttempts, "retry-max-attempts", DefaultMaxAttempts, "most attempts per call, the first included (1 to 5)")
	fs.DurationVar(&r.Base, "retry-base", DefaultBase, "backoff base (full jitter)")
	fs.DurationVar(&r.Cap, "retry-cap", DefaultCap, "backoff cap")
	fs.Float64Var(&r.BudgetRatio, "retry-budget-ratio", DefaultBudgetRatio, "retries may add at most this share of calls per target")
	fs.Float64Var(&r.BudgetRPS, "retry-budget-per-second", DefaultBudgetPerSecond, "retries allowed per second beyond the ratio")
	fs.BoolVar(&r.Throttle, "retry-throttle", false, "client-side adaptive throttling (SRE book)")
	fs.StringVar(&r.Coordination, "retry-coordination", DefaultCoordination, "with a --store other replicas share: store coordinates each target's retries in the retry file's windows (at most window.replicas replicas retry it at a time); off lets each replica retry on its own (see docs/cluster.md)")
}

// Load builds the retry File the flags describe: the --retry-config file if given, then
// the flags given explicitly (explicit holds their names, without dashes); without a
// file every flag applies, defaults included.
func (r *Flags) Load(explicit map[string]bool) (*File, error) {
	f := &File{}
	if r.File != "" {
		var err error
		if f, err = LoadFile(r.File); err != nil {
			return nil, fmt.Errorf("--retry-config: %w", err)
		}
	}
	return r.apply(f, explicit)
}

// Decode is Load with data as the content of the --retry-config file: what a reload of
// the file does (the flags given explicitly still override it).
func (r *Flags) Decode(data []byte, explicit map[string]bool) (*File, error) {
	f, err := DecodeFile(data)
	if err != nil {
		return nil, err
	}
	return r.apply(f, explicit)
}

// apply sets on f what the flags say, and validates the result.
func (r *Flags) apply(f *File, explicit map[string]bool) (*File, error) {
	set := func(name string) bool { return explicit[name] || r.File == "" }
	if r.Off {
		t := true
		f.Default.Disabled = &t
		f.Targets = nil
	}
	if set("retry-max-attempts") {
		f.Default.MaxAttempts = &r.MaxAttempts
	}
	if set("retry-base") {
		d := Duration(r.Base)
		f.Default.Base = &d
	}
	if set("retry-cap") {
		d := Duration(r.Cap)
		f.Default.Cap = &d
	}
	if set("retry-budget-ratio") {
		f.Budget.Ratio = &r.BudgetRatio
	}
	if set("retry-budget-per-second") {
		f.Budget.PerSecond = &r.BudgetRPS
	}
	if explicit["retry-throttle"] || (r.File == "" && r.Throttle) {
		f.Throttle = r.Throttle
	}
	switch r.Coordination {
	case "", CoordinationStore:
	case CoordinationOff:
		f.Window.Disabled = true
	default:
		return nil, fmt.Errorf("--retry-coordination must be %s or %s, got %q", CoordinationStore, CoordinationOff, r.Coordination)
	}
	if err := f.Validate(); err != nil {
		return nil, fmt.Errorf("retry flags: %w", err)
	}
	return f, nil
}
