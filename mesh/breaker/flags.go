package breaker

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"time"
)

// DefaultOff is --breaker-off's default: the breakers are on.
const DefaultOff = false

// The values of --breaker-coordination.
const (
	// CoordinationStore: with a store other processes share, one half-open probe per
	// target across every replica (Set.Coordinate, docs/cluster.md).
	CoordinationStore = "store"
	// CoordinationOff: each replica's breakers probe on their own.
	CoordinationOff = "off"
	// DefaultCoordination is --breaker-coordination's default.
	DefaultCoordination = CoordinationStore
)

// Flags are the circuit breaker flags every service has (--breaker-*): one breaker per
// downstream service name. Set without flags (Register not called), a zero field means
// Config's default for it, and Off is false. Set by flags, whose defaults are this
// package's, a zero is refused, except --breaker-jitter=0, which means no jitter.
type Flags struct {
	Off         bool
	Failures    uint
	Ratio       float64
	MinRequests uint
	Window      time.Duration
	OpenTimeout time.Duration
	Jitter      float64
	// Coordination is CoordinationStore or CoordinationOff; "" means
	// DefaultCoordination. It takes effect where the service calls Set.Coordinate.
	Coordination string
}

// Coordinated reports whether the flags ask for cluster-wide probes
// (--breaker-coordination=store, the default).
func (b Flags) Coordinated() bool { return b.Coordination == "" || b.Coordination == CoordinationStore }

// Register adds the breaker flags to fs, with this package's defaults.
func (b *Flags) Register(fs *flag.FlagSet) {
	fs.BoolVar(&b.Off, "breaker-off", DefaultOff, "no circuit breakers on calls to other services (see docs/breakers.md)")
	fs.UintVar(&b.Failures, "breaker-failures", DefaultConsecutiveFailures, "a target's breaker opens after this many consecutive failures")
	fs.Float64Var(&b.Ratio, "breaker-ratio", DefaultFailureRatio, "a target's breaker also opens when at least this share (0 to 1] of its calls in the window failed")
	fs.UintVar(&b.MinRequests, "breaker-min-requests", DefaultMinRequests, "fewest judged calls in the window before --breaker-ratio applies")
	fs.DurationVar(&b.Window, "breaker-window", DefaultWindow, "rolling window over which a breaker counts outcomes")
	fs.DurationVar(&b.OpenTimeout, "breaker-open-timeout", DefaultOpenTimeout, "how long an open breaker refuses calls before one probe goes through")
	fs.Float64Var(&b.Jitter, "breaker-jitter", DefaultJitter, "each open period is --breaker-open-timeout ± this fraction, in [0, 1); 0 for none")
	fs.StringVar(&b.Coordination, "breaker-coordination", DefaultCoordination, "with a --store other replicas share: store sends one half-open probe per target across all replicas and shares its outcome; off lets each replica probe on its own (see docs/cluster.md)")
}

// flagNames names the flag of each Config field.
var flagNames = map[string]string{
	"ConsecutiveFailures": "--breaker-failures", "FailureRatio": "--breaker-ratio", "MinRequests": "--breaker-min-requests",
	"Window": "--breaker-window", "OpenTimeout": "--breaker-open-timeout", "Jitter": "--breaker-jitter",
}

// Config returns the Config the flags describe, validated, its errors naming the flags;
// fromFlags says whether they were registered as flags (see Flags).
func (b Flags) Config(fromFlags bool) (Config, error) {
	if fromFlags {
		switch {
		case b.Failures == 0:
			return Config{}, errors.New("--breaker-failures must be at least 1")
		case b.MinRequests == 0:
			return Config{}, errors.New("--breaker-min-requests must be at least 1")
		case b.Ratio == 0:
			return Config{}, errors.New("--breaker-ratio must be in (0, 1], got 0")
		case b.Window == 0:
			return Config{}, fmt.Errorf("--breaker-window must be at least %v, got 0s", MinWindow)
		case b.OpenTimeout == 0:
			return Config{}, fmt.Errorf("--breaker-open-timeout must be at least %v, got 0s", MinOpenTimeout)
		case b.Jitter < 0:
			return Config{}, fmt.Errorf("--breaker-jitter must be in [0, 1), got %v", b.Jitter)
		}
	}
	if b.Coordination != "" && b.Coordination != CoordinationStore && b.Coordination != CoordinationOff {
		return Config{}, fmt.Errorf("--breaker-coordination must be %s or %s, got %q", CoordinationStore, CoordinationOff, b.Coordination)
	}
	if b.Failures > math.MaxUint32 || b.MinRequests > math.MaxUint32 {
		return Config{}, fmt.Errorf("--breaker-failures and --breaker-min-requests must be at most %d", uint32(math.MaxUint32))
	}
	jitter := b.Jitter
	if fromFlags && jitter == 0 {
		jitter = -1 // none
	}
	cfg := Config{Off: b.Off, ConsecutiveFailures: uint32(b.Failures), FailureRatio: b.Ratio, MinRequests: uint32(b.MinRequests),
		Window: b.Window, OpenTimeout: b.OpenTimeout, Jitter: jitter}
	if err := cfg.Validate(); err != nil {
		var ce *ConfigError
		if errors.As(err, &ce) {
			v := ce.Value
			if ce.Field == "Jitter" {
				v = b.Jitter
			}
			return Config{}, fmt.Errorf("%s %v: %s", flagNames[ce.Field], v, ce.Reason)
		}
		return Config{}, err
	}
	return cfg, nil
}
