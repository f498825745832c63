package cancel_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var causes = []struct {
	err  error
	want meshv1.CancelCause
	name string
}{
	{cancel.ErrClientDisconnect, meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT, "client_disconnect"},
	{cancel.ErrDeadline, meshv1.CancelCause_CANCEL_CAUSE_DEADLINE, "deadline"},
	{cancel.ErrOperator, meshv1.CancelCause_CANCEL_CAUSE_OPERATOR, "operator"},
	{cancel.ErrSiblingFailed, meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED, "sibling_failed"},
	{cancel.ErrSuperseded, meshv1.CancelCause_CANCEL_CAUSE_SUPERSEDED, "superseded"},
	{cancel.ErrBudget, meshv1.CancelCause_CANCEL_CAUSE_BUDGET, "budget"},
	{cancel.ErrLeaseExpired, meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED, "lease_expired"},
	{cancel.ErrApprovalTimeout, meshv1.CancelCause_CANCEL_CAUSE_APPROVAL_TIMEOUT, "approval_timeout"},
}

func TestCauseOf(t *testing.T) {
	for _, c := range causes {
		ctx, stop := context.WithCancelCause(context.Background())
		if got := cancel.CauseOf(ctx); got != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
			t.Errorf("live ctx: CauseOf = %v, want UNSPECIFIED", got)
		}
		stop(c.err)
		if got := cancel.CauseOf(ctx); got != c.want {
			t.Errorf("cancelled with %v: CauseOf = %v, want %v", c.err, got, c.want)
		}
		// A child sees the parent's cause.
		child, cc := context.WithCancel(ctx)
		if got := cancel.CauseOf(child); got != c.want {
			t.Errorf("child of ctx cancelled with %v: CauseOf = %v, want %v", c.err, got, c.want)
		}
		cc()
		if got := cancel.FromError(fmt.Errorf("wrapped: %w", c.err)); got != c.want {
			t.Errorf("FromError(wrapped %v) = %v, want %v", c.err, got, c.want)
		}
	}
}

func TestCauseOfPlainContexts(t *testing.T) {
	ctx, stop := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer stop()
	if got := cancel.CauseOf(ctx); got != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
		t.Errorf("expired deadline: CauseOf = %v, want DEADLINE", got)
	}
	ctx2, stop2 := context.WithCancel(context.Background())
	stop2()
	if got := cancel.CauseOf(ctx2); got != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		t.Errorf("plain cancel (as from an upstream RST_STREAM): CauseOf = %v, want UNSPECIFIED", got)
	}
	ctx3, stop3 := context.WithTimeoutCause(context.Background(), -time.Second, cancel.ErrBudget)
	defer stop3()
	if got := cancel.CauseOf(ctx3); got != meshv1.CancelCause_CANCEL_CAUSE_BUDGET {
		t.Errorf("deadline with a cause: CauseOf = %v, want BUDGET", got)
	}
	if got := cancel.FromError(nil); got != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		t.Errorf("FromError(nil) = %v", got)
	}
	if got := cancel.FromError(errors.New("other")); got != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		t.Errorf("FromError(unknown) = %v", got)
	}
	if got := cancel.FromError(context.DeadlineExceeded); got != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
		t.Errorf("FromError(context.DeadlineExceeded) = %v", got)
	}
}

func TestName(t *testing.T) {
	for _, c := range causes {
		if got := cancel.Name(c.want); got != c.name {
			t.Errorf("Name(%v) = %q, want %q", c.want, got, c.name)
		}
	}
	if got := cancel.Name(meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED); got != "" {
		t.Errorf("Name(UNSPECIFIED) = %q, want empty", got)
	}
}

// Parse inverts Name, so a cause stored by name reads back as itself.
func TestParse(t *testing.T) {
	for _, c := range causes {
		if got := cancel.Parse(cancel.Name(c.want)); got != c.want {
			t.Errorf("Parse(Name(%v)) = %v", c.want, got)
		}
	}
	for _, name := range []string{"", "bogus", "CANCEL_CAUSE_DEADLINE"} {
		if got := cancel.Parse(name); got != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
			t.Errorf("Parse(%q) = %v, want UNSPECIFIED", name, got)
		}
	}
}

type key struct{}

func TestCleanupRunsDetachedOnItsOwnBudget(t *testing.T) {
	for _, name := range []string{"cancelled", "expired"} {
		t.Run(name, func(t *testing.T) {
			parent := context.WithValue(context.Background(), key{}, "run-9")
			var ctx context.Context
			if name == "cancelled" {
				c, stop := context.WithCancelCause(parent)
				stop(cancel.ErrOperator)
				ctx = c
			} else {
				c, stop := context.WithDeadline(parent, time.Now().Add(-time.Second))
				defer stop()
				ctx = c
			}
			const budget = 2 * time.Second
			start := time.Now()
			sentinel := errors.New("cleanup result")
			err := cancel.Cleanup(ctx, budget, func(cctx context.Context) error {
				if cctx.Err() != nil {
					t.Errorf("cleanup ctx already done: %v", cctx.Err())
				}
				if v := cctx.Value(key{}); v != "run-9" {
					t.Errorf("cleanup ctx lost the values: got %v", v)
				}
				dl, ok := cctx.Deadline()
				if !ok || dl.Before(start.Add(budget)) || dl.After(time.Now().Add(budget)) {
					t.Errorf("cleanup deadline = %v from start (ok=%v), want the budget %v", dl.Sub(start), ok, budget)
				}
				return sentinel
			})
			if !errors.Is(err, sentinel) {
				t.Errorf("Cleanup returned %v, want fn's error", err)
			}
		})
	}
}

func TestCleanupIsBoundedByBudget(t *testing.T) {
	ctx, stop := context.WithCancel(context.Background())
	stop()
	const budget = 150 * time.Millisecond
	start := time.Now()
	err := cancel.Cleanup(ctx, budget, func(cctx context.Context) error {
		<-cctx.Done() // a cleanup that takes longer than its budget
		return cctx.Err()
	})
	elapsed := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want the budget's DeadlineExceeded", err)
	}
	if elapsed < budget || elapsed > budget+2*time.Second {
		t.Errorf("cleanup took %v, want about the budget %v", elapsed, budget)
	}
}

func TestCleanupDefaultBudget(t *testing.T) {
	for _, b := range []time.Duration{0, -time.Second} {
		start := time.Now()
		_ = cancel.Cleanup(context.Background(), b, func(cctx context.Context) error {
			dl, ok := cctx.Deadline()
			if !ok || dl.Before(start.Add(cancel.DefaultCleanupBudget)) || dl.After(time.Now().Add(cancel.DefaultCleanupBudget)) {
				t.Errorf("budget %v: deadline %v from start, want DefaultCleanupBudget %v", b, dl.Sub(start), cancel.DefaultCleanupBudget)
			}
			return nil
		})
	}
}

func TestResolve(t *testing.T) {
	parent := func(id string) string {
		if i := strings.LastIndexByte(id, '/'); i >= 0 {
			return id[:i]
		}
		return ""
	}
	m := map[string]meshv1.CancelCause{
		"root":             meshv1.CancelCause_CANCEL_CAUSE_OPERATOR,
		"root/s0.t1":       meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED,
		"root/s0.t1/sub":   meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED,
		"other":            meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED,
		"root/s0.t10":      meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED,
		"root/s0.t1/sub/x": meshv1.CancelCause_CANCEL_CAUSE_DEADLINE,
	}
	cases := map[string]meshv1.CancelCause{
		"root/s0.t1/sub/x":    meshv1.CancelCause_CANCEL_CAUSE_DEADLINE,       // its own
		"root/s0.t1/sub/m0":   meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED, // nearest known ancestor
		"root/s0.t1/sub":      meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED,
		"root/s0.t10":         meshv1.CancelCause_CANCEL_CAUSE_OPERATOR, // not beneath root/s0.t1
		"root/m0":             meshv1.CancelCause_CANCEL_CAUSE_OPERATOR,
		"other/x":             meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED,
		"unknown":             meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED,
		"root/s0.t1/sub/x/y1": meshv1.CancelCause_CANCEL_CAUSE_DEADLINE,
	}
	for id, want := range cases {
		if got := cancel.Resolve(m, id, parent); got != want {
			t.Errorf("Resolve(%q) = %v, want %v", id, got, want)
		}
	}
}

func TestErrorOfRoundTrips(t *testing.T) {
	for _, c := range causes {
		if got := cancel.ErrorOf(c.want); !errors.Is(got, c.err) {
			t.Errorf("ErrorOf(%v) = %v, want %v", c.want, got, c.err)
		}
		if got := cancel.FromError(cancel.ErrorOf(c.want)); got != c.want {
			t.Errorf("FromError(ErrorOf(%v)) = %v", c.want, got)
		}
	}
	if err := cancel.ErrorOf(meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED); err != nil {
		t.Errorf("ErrorOf(UNSPECIFIED) = %v, want nil", err)
	}
}
