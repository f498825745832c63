package breaker

import (
	"fmt"
	"math"
	"time"
)

// Defaults of Config's zero fields.
const (
	// DefaultConsecutiveFailures trips a breaker after 5 failures in a row: a target that
	// fails every call is fenced off within a few calls even at low traffic.
	DefaultConsecutiveFailures = 5
	// DefaultFailureRatio trips a breaker when half of the judged calls in the window failed.
	DefaultFailureRatio = 0.5
	// DefaultMinRequests is the fewest judged calls in the window before the ratio counts,
	// so that two failures out of three never trip it.
	DefaultMinRequests = 20
	// DefaultWindow is the closed state's rolling counting window.
	DefaultWindow = 10 * time.Second
	// DefaultOpenTimeout is how long a breaker stays open before its half-open probe.
	DefaultOpenTimeout = 5 * time.Second
	// DefaultJitter spreads each open period uniformly over OpenTimeout ± 20 %, so that the
	// breakers of many clients of one target do not probe it in the same instant.
	DefaultJitter = 0.2
)

// Bounds checked by Validate.
const (
	// MinWindow is the shortest window: it is counted in WindowBuckets buckets of at least
	// a millisecond.
	MinWindow = 10 * time.Millisecond
	// MinOpenTimeout is the shortest open period.
	MinOpenTimeout = time.Millisecond
	// WindowBuckets is the number of buckets of the rolling window (gobreaker's
	// BucketPeriod is Window / WindowBuckets): a failure leaves the count between
	// 0.9 and 1 Window after it happened.
	WindowBuckets = 10
)

// Config configures the breakers of a Set (one per target). The zero value is the
// defaults (the Default* constants).
//
// A breaker trips (closed → open) when either ConsecutiveFailures calls in a row failed,
// or, once the window holds at least MinRequests judged calls (successes plus failures;
// ignored outcomes such as cancellations are not judged), failures/judged ≥ FailureRatio.
// Both counts are over the rolling Window. What counts as a failure is [Classify]'s.
type Config struct {
	// ConsecutiveFailures trips the breaker after this many consecutive failures; 0 means
	// DefaultConsecutiveFailures.
	ConsecutiveFailures uint32
	// FailureRatio trips the breaker when failures/judged ≥ this over Window, once Window
	// holds MinRequests judged calls; in (0, 1], 0 means DefaultFailureRatio.
	FailureRatio float64
	// MinRequests is the fewest judged calls in Window for FailureRatio to apply; 0 means
	// DefaultMinRequests.
	MinRequests uint32
	// Window is the closed state's rolling counting window (gobreaker buckets, see
	// WindowBuckets); 0 means DefaultWindow.
	Window time.Duration
	// OpenTimeout is the nominal open period, after which one probe is let through
	// (half-open); 0 means DefaultOpenTimeout.
	OpenTimeout time.Duration
	// Jitter spreads each open period uniformly over OpenTimeout·[1−Jitter, 1+Jitter);
	// below 1. 0 means DefaultJitter; a negative value turns jitter off.
	Jitter float64
	// Off turns breaking off: every call is allowed and nothing is counted.
	Off bool
}

// WithDefaults returns c with its zero fields set to the defaults. It is idempotent.
func (c Config) WithDefaults() Config {
	if c.ConsecutiveFailures == 0 {
		c.ConsecutiveFailures = DefaultConsecutiveFailures
	}
	if c.FailureRatio == 0 {
		c.FailureRatio = DefaultFailureRatio
	}
	if c.MinRequests == 0 {
		c.MinRequests = DefaultMinRequests
	}
	if c.Window == 0 {
		c.Window = DefaultWindow
	}
	if c.OpenTimeout == 0 {
		c.OpenTimeout = DefaultOpenTimeout
	}
	if c.Jitter == 0 {
		c.Jitter = DefaultJitter
	}
	return c
}

// ConfigError is Validate's error: which field is wrong and why.
type ConfigError struct {
	// Field is the Config field's name ("FailureRatio").
	Field string
	// Value is the value given.
	Value any
	// Reason says what the value must be.
	Reason string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("breaker: %s %v: %s", e.Field, e.Value, e.Reason)
}

// Validate reports the first field of c (with defaults applied) outside its bounds, as a
// *ConfigError.
func (c Config) Validate() error {
	d := c.WithDefaults()
	switch {
	case math.IsNaN(d.FailureRatio) || d.FailureRatio < 0 || d.FailureRatio > 1:
		return &ConfigError{"FailureRatio", c.FailureRatio, "must be in (0, 1]"}
	case d.Window < MinWindow:
		return &ConfigError{"Window", c.Window, fmt.Sprintf("must be at least %v", MinWindow)}
	case d.OpenTimeout < MinOpenTimeout:
		return &ConfigError{"OpenTimeout", c.OpenTimeout, fmt.Sprintf("must be at least %v", MinOpenTimeout)}
	case math.IsNaN(d.Jitter) || d.Jitter >= 1:
		return &ConfigError{"Jitter", c.Jitter, "must be below 1 (negative: no jitter)"}
	case d.openMin() < MinOpenTimeout:
		return &ConfigError{"Jitter", c.Jitter, fmt.Sprintf("leaves an open period shorter than %v with OpenTimeout %v", MinOpenTimeout, d.OpenTimeout)}
	}
	return nil
}

// jitter is the effective jitter of a defaulted config: 0 when turned off.
func (c Config) jitter() float64 {
	if c.Jitter < 0 {
		return 0
	}
	return c.Jitter
}

// openMin is the shortest open period of a defaulted config: gobreaker's own Timeout.
func (c Config) openMin() time.Duration {
	return time.Duration(float64(c.OpenTimeout) * (1 - c.jitter()))
}

// openPeriod is the open period for a uniform draw u in [0, 1): OpenTimeout·(1−J+2J·u),
// uniform over [OpenTimeout·(1−J), OpenTimeout·(1+J)).
func (c Config) openPeriod(u float64) time.Duration {
	return c.openMin() + time.Duration(2*c.jitter()*u*float64(c.OpenTimeout))
}
