package deadline

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Defaults of Policy's zero fields.
const (
	// DefaultTimeout is given to a request that arrives without a deadline.
	DefaultTimeout = 30 * time.Second
	// DefaultMax caps any deadline a caller asks for.
	DefaultMax = 10 * time.Minute
)

// Policy normalizes the deadline of incoming work. The zero value uses DefaultTimeout
// and DefaultMax.
type Policy struct {
	// Default is the timeout of a request without a deadline.
	Default time.Duration
	// Max is the longest time from arrival a request may run.
	Max time.Duration
}

// Info says what Apply did.
type Info struct {
	// Deadline is the deadline the work now runs under.
	Deadline time.Time
	// Assigned is true when the request had no deadline and got the default.
	Assigned bool
	// Capped is true when the request's deadline was beyond Max and was shortened.
	Capped bool
}

// def is the default timeout, never more than the maximum (a policy that only sets a
// small Max still caps requests without a deadline).
func (p Policy) def() time.Duration {
	d := DefaultTimeout
	if p.Default > 0 {
		d = p.Default
	}
	return min(d, p.MaxTimeout())
}

// MaxTimeout returns the policy's effective maximum.
func (p Policy) MaxTimeout() time.Duration {
	if p.Max > 0 {
		return p.Max
	}
	return DefaultMax
}

// Validate reports a policy whose default exceeds its maximum.
func (p Policy) Validate() error {
	if p.Default < 0 || p.Max < 0 {
		return fmt.Errorf("deadline: default and max must not be negative")
	}
	if p.Default > p.MaxTimeout() {
		return fmt.Errorf("deadline: default %v exceeds max %v", p.Default, p.MaxTimeout())
	}
	return nil
}

// Apply returns a context whose deadline is the request's own, the default when it has
// none, or now+Max when it asked for more. It never extends the deadline of ctx. The
// returned cancel func must be called.
func (p Policy) Apply(ctx context.Context, now time.Time) (context.Context, context.CancelFunc, Info) {
	cur, ok := ctx.Deadline()
	info := p.Resolve(cur, ok, now)
	if !info.Assigned && !info.Capped {
		return ctx, func() {}, info
	}
	c, cancel := context.WithDeadline(ctx, info.Deadline) // shortens: WithDeadline keeps the earlier one
	return c, cancel, info
}

// Resolve is Apply without the context: the deadline work that has deadline cur (ok false
// when it has none) and arrived at now runs under. Assigned or Capped is set when that
// differs from cur.
func (p Policy) Resolve(cur time.Time, ok bool, now time.Time) Info {
	limit := now.Add(p.MaxTimeout())
	switch {
	case !ok:
		return Info{Deadline: now.Add(p.def()), Assigned: true}
	case cur.After(limit):
		return Info{Deadline: limit, Capped: true}
	default:
		return Info{Deadline: cur}
	}
}

// Remaining returns the time left before ctx's deadline, or a very large duration when it
// has none.
func Remaining(ctx context.Context, now time.Time) time.Duration {
	dl, ok := ctx.Deadline()
	if !ok {
		return time.Duration(1<<63 - 1)
	}
	return dl.Sub(now)
}

// Check fails fast before starting work named what: it returns a DEADLINE_EXCEEDED status
// "no time left to start <what>" when less than min remains before ctx's deadline, and the
// context's own error when it is already done.
func Check(ctx context.Context, min time.Duration, what string) error {
	if err := ctx.Err(); err != nil {
		if err == context.DeadlineExceeded {
			return status.Errorf(codes.DeadlineExceeded, "no time left to start %s", what)
		}
		return status.Errorf(codes.Canceled, "cancelled before starting %s", what)
	}
	if left := Remaining(ctx, time.Now()); left < min {
		return status.Errorf(codes.DeadlineExceeded, "no time left to start %s: %v left, needs %v",
			what, left.Round(time.Millisecond), min)
	}
	return nil
}

// DefaultSkewTolerance is how far the absolute curfew-deadline may lie before the gRPC
// deadline and still be taken as the same deadline (transit delay and rounding), rather
// than as a skewed clock.
const DefaultSkewTolerance = time.Second

// Reconcile compares the caller's absolute deadline abs (curfew-deadline) with the gRPC
// deadline on ctx. The relative gRPC deadline reaches the callee later than the caller
// computed it, by the transit delay, so on its own it would let a child's deadline lie a
// little after its parent's. When abs is earlier by at most tolerance, Reconcile shortens
// ctx to abs, so a child never sees a later deadline than its parent. When abs is earlier
// by more, the clocks disagree: the gRPC deadline stays authoritative, and skew reports the
// difference.
// The returned cancel func must be called.
func Reconcile(ctx context.Context, abs time.Time, tolerance time.Duration) (_ context.Context, _ context.CancelFunc, skew time.Duration) {
	dl, ok := ctx.Deadline()
	if !ok || abs.IsZero() {
		return ctx, func() {}, 0
	}
	final, skew := Reconciled(dl, abs, tolerance)
	if !final.Before(dl) {
		return ctx, func() {}, skew
	}
	c, cancel := context.WithDeadline(ctx, final)
	return c, cancel, 0
}

// Reconciled is Reconcile without the context: the deadline that work with the gRPC
// deadline dl and the caller's absolute deadline abs (zero when unknown) runs under, and
// the clock skew it detected (then dl is kept).
func Reconciled(dl, abs time.Time, tolerance time.Duration) (final time.Time, skew time.Duration) {
	if abs.IsZero() {
		return dl, 0
	}
	d := dl.Sub(abs)
	switch {
	case d <= 0:
		return dl, 0
	case d <= tolerance:
		return abs, 0
	default:
		return dl, d
	}
}
