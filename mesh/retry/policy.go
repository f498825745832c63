package retry

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Defaults of Policy's zero fields, from the anchors (see the package doc).
const (
	DefaultMaxAttempts    = 3
	MaxMaxAttempts        = 5
	DefaultBase           = 25 * time.Millisecond
	DefaultCap            = 250 * time.Millisecond
	DefaultMinAttemptTime = 10 * time.Millisecond
)

// Marker of an error retried to exhaustion (see the package doc).
const (
	ExhaustedReason = "RETRIES_EXHAUSTED"
	ExhaustedDomain = "curfew.dev"
	// PushbackHeader is the trailer a server sets to push back (gRFC A6).
	PushbackHeader = "grpc-retry-pushback-ms"
)

// Policy says whether and when to retry one method. The zero value retries UNAVAILABLE up
// to DefaultMaxAttempts with the default backoff.
type Policy struct {
	// Disabled turns retries off.
	Disabled bool
	// MaxAttempts is the most attempts, the first included; at most MaxMaxAttempts.
	MaxAttempts int
	// Base and Cap shape the backoff: attempt n (n ≥ 2) waits a uniformly random time in
	// [0, min(Cap, Base·2^(n−2))).
	Base, Cap time.Duration
	// MinAttemptTime is the least time left to start an attempt.
	MinAttemptTime time.Duration
	// NonIdempotent marks a method with side effects: retried only when the call carries an
	// idempotency key (curfew-idempotency-key).
	NonIdempotent bool
	// Naive is the policy curfew exists to replace, kept for comparison benchmarks: retry
	// errors that a layer below already retried, do not mark exhaustion, and retry streams
	// even after their first message, so every layer retries (3 layers × 3 attempts = 27 at
	// the leaf).
	Naive bool
}

// WithDefaults returns p with its zero fields defaulted.
func (p Policy) WithDefaults() Policy {
	if p.MaxAttempts == 0 {
		p.MaxAttempts = DefaultMaxAttempts
	}
	if p.Base == 0 {
		p.Base = DefaultBase
	}
	if p.Cap == 0 {
		p.Cap = DefaultCap
	}
	if p.MinAttemptTime == 0 {
		p.MinAttemptTime = DefaultMinAttemptTime
	}
	return p
}

// Validate reports a policy outside its bounds.
func (p Policy) Validate() error {
	switch {
	case p.MaxAttempts < 0 || p.MaxAttempts > MaxMaxAttempts:
		return fmt.Errorf("max_attempts must be between 1 and %d, got %d", MaxMaxAttempts, p.MaxAttempts)
	case p.Base < 0 || p.Cap < 0 || p.MinAttemptTime < 0:
		return errors.New("base, cap and min_attempt_time must not be negative")
	case p.Base > 0 && p.Cap > 0 && p.Base > p.Cap:
		return fmt.Errorf("base %v exceeds cap %v", p.Base, p.Cap)
	}
	return nil
}

// Backoff returns the full-jitter delay before attempt n (n ≥ 2); rnd returns a value in
// [0, 1).
func (p Policy) Backoff(n int, rnd func() float64) time.Duration {
	p = p.WithDefaults()
	if n < 2 {
		return 0
	}
	ceil := float64(p.Base) * math.Pow(2, float64(n-2))
	if ceil > float64(p.Cap) {
		ceil = float64(p.Cap)
	}
	return time.Duration(rnd() * ceil)
}

// Verdict is the retry decision after a failed attempt.
type Verdict int

// Verdicts.
const (
	// Retry after the returned delay.
	Retry Verdict = iota
	// GiveUp returns the error as it is: not retryable, or retries off.
	GiveUp
	// Exhausted returns the error marked as retried to exhaustion.
	Exhausted
	// NoTime fails with DEADLINE_EXCEEDED: the wait would end too late.
	NoTime
)

// Decision is Decide's answer.
type Decision struct {
	Verdict Verdict
	Delay   time.Duration
	// Reason names why, for logs and metrics ("not_retryable", "pushback_stop", ...).
	Reason string
}

// Decide judges a failed attempt n of a call: err is its error, trailer its trailer
// metadata, left the time left before the call's deadline (a very large value when it has
// none), hasKey whether it carries an idempotency key.
func (p Policy) Decide(err error, trailer metadata.MD, n int, left time.Duration, hasKey bool, rnd func() float64) Decision {
	p = p.WithDefaults()
	st := status.Convert(err)
	push, pushed, stop := Pushback(st, trailer)
	switch {
	case p.Disabled:
		return Decision{Verdict: GiveUp, Reason: "disabled"}
	case IsExhausted(err) && !p.Naive:
		return Decision{Verdict: GiveUp, Reason: "retried_below"}
	case stop:
		return Decision{Verdict: GiveUp, Reason: "pushback_stop"}
	case st.Code() == codes.Unavailable:
	case st.Code() == codes.ResourceExhausted && pushed:
	default:
		return Decision{Verdict: GiveUp, Reason: "not_retryable"}
	}
	if p.NonIdempotent && !hasKey {
		return Decision{Verdict: GiveUp, Reason: "side_effect_without_key"}
	}
	if n >= p.MaxAttempts {
		return Decision{Verdict: Exhausted, Reason: "max_attempts"}
	}
	delay := p.Backoff(n+1, rnd)
	if pushed {
		delay = push
	}
	if delay+p.MinAttemptTime > left {
		return Decision{Verdict: NoTime, Delay: delay, Reason: "deadline"}
	}
	return Decision{Verdict: Retry, Delay: delay, Reason: "retryable"}
}

// Pushback reads a server's pushback from the status details (RetryInfo) or the trailer.
// pushed reports a delay; stop reports "don't retry" (a negative or malformed trailer).
func Pushback(st *status.Status, trailer metadata.MD) (delay time.Duration, pushed, stop bool) {
	if v := trailer.Get(PushbackHeader); len(v) > 0 {
		ms, err := strconv.Atoi(v[0])
		if err != nil || ms < 0 {
			return 0, false, true
		}
		return time.Duration(ms) * time.Millisecond, true, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			dl := ri.GetRetryDelay().AsDuration()
			if dl < 0 {
				return 0, false, true
			}
			return dl, true, false
		}
	}
	return 0, false, false
}

// IsExhausted reports whether err carries the retried-to-exhaustion marker.
func IsExhausted(err error) bool {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == ExhaustedReason && ei.GetDomain() == ExhaustedDomain {
			return true
		}
	}
	return false
}

// MarkExhausted returns err with the retried-to-exhaustion marker, keeping its code,
// message and details.
func MarkExhausted(err error, attempts int) error {
	if IsExhausted(err) {
		return err
	}
	st := status.Convert(err)
	marked, derr := st.WithDetails(&errdetails.ErrorInfo{Reason: ExhaustedReason, Domain: ExhaustedDomain,
		Metadata: map[string]string{"attempts": strconv.Itoa(attempts)}})
	if derr != nil {
		return err
	}
	return marked.Err()
}

func errorf(format string, args ...any) error { return fmt.Errorf(format, args...) }
