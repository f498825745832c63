package toolrunner

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/idempotency"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
)

// DefaultApprovalPoll is how often a call waiting for approval reads its request.
const DefaultApprovalPoll = 250 * time.Millisecond

// The ApprovalGate event's states (meshv1.ApprovalGate.state) and the outcomes of
// curfew_tool_approvals_total.
const (
	gateWaiting   = "waiting_approval"
	gateApproved  = "approved"
	gateDenied    = "denied"
	gateTimeout   = "approval_timeout"
	gateCancelled = "cancelled"
)

// gate says whether a call waits for a human's approval before its effect: why (""
// when it does not: registry.ApprovalRegistry, ApprovalDestructiveHint, ApprovalPlan)
// and the tool's minimum time, which the wait leaves before the deadline.
type gate struct {
	why     string
	minTime time.Duration
}

// builtinMinTime is a built-in's minimum time: notify's grace (it refuses to send with
// less left), the registry's default for the others.
func builtinMinTime(name string, raw []byte) time.Duration {
	if name == plan.ToolNotify {
		var a plan.NotifyArgs
		if plan.Args(raw, &a) == nil && a.GraceMS > 0 {
			return time.Duration(a.GraceMS) * time.Millisecond
		}
		return plan.DefaultNotifyGrace * time.Millisecond
	}
	return registry.DefaultMinTime
}

// errApprovalTimeout marks a call denied because no decision came before its wait's
// cap: its node's cause is approval_timeout.
var errApprovalTimeout = errors.New("approval timeout")

// approvalTimeout is the error of a call whose wait reached its cap.
type approvalTimeout struct{ st *status.Status }

func (e approvalTimeout) Error() string              { return e.st.Err().Error() }
func (e approvalTimeout) GRPCStatus() *status.Status { return e.st }
func (e approvalTimeout) Is(target error) bool       { return target == errApprovalTimeout }

// approvals counts the ends of approval waits, by outcome (known in advance: at 0).
func newApprovalsMetric() *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "curfew_tool_approvals_total",
		Help: "Tool calls that waited for a human's approval, by how the wait ended: approved, denied, approval_timeout (no decision before the run's deadline less the tool's minimum time) or cancelled.",
	}, []string{"outcome"})
	for _, o := range []string{gateApproved, gateDenied, gateTimeout, gateCancelled} {
		c.WithLabelValues(o)
	}
	return c
}

// gated returns exec behind an approval gate: before the effect, the call's request is
// created, or found when the call was sent before (the same run, node and idempotency
// key: a call re-sent after a takeover keeps waiting on the request it made), and the
// node reports waiting_approval; the request is then polled until it is decided, until
// the cap (the deadline less the tool's minimum time), or until the call is cancelled.
// Approved, exec runs (once: its own idempotency still guards it). Denied, the call's
// result is the denial, FAILED_PRECONDITION with the approver's reason, which a model
// gets as the tool's error and a plan's step sees. At the cap, the request is marked
// timed out and the call denied likewise, its node's cause approval_timeout. Cancelled,
// the request is marked cancelled when the run's cancel names a cause; a call whose
// caller merely went away (an orchestrator that died: its run will be taken over and the
// call sent again), or that a takeover superseded, leaves it pending.
func (s *Server) gated(exec execFunc, g gate, name string, raw []byte, event func(*meshv1.NodeEvent)) execFunc {
	return func(ctx context.Context) (string, *meshv1.Cleanup, error) {
		if !s.cfg.Store.Shared() {
			return "", nil, status.Errorf(codes.FailedPrecondition,
				"tool %s needs a human's approval (%s), which needs toolrunner's durable store (--store)", name, g.why)
		}
		id := md.IdentityFrom(ctx)
		tenant := id.Tenant
		if tenant == "" {
			tenant = md.DefaultTenant
		}
		key := md.IdempotencyKeyFrom(ctx)
		if key == "" { // the same on every attempt of the call, and after a takeover
			k, err := idempotency.DeriveKey(id.RunID, id.NodeID, name, raw)
			if err != nil {
				return "", nil, status.Errorf(codes.InvalidArgument, "tool %s: %v", name, err)
			}
			key = k
		}
		var capAt time.Time
		if dl, ok := ctx.Deadline(); ok {
			capAt = dl.Add(-g.minTime)
		}
		if abs, ok := md.IncomingDeadline(ctx); ok && (capAt.IsZero() || abs.Add(-g.minTime).Before(capAt)) {
			capAt = abs.Add(-g.minTime)
		}
		req, _, err := s.cfg.Store.RequestApproval(ctx, store.Approval{Tenant: tenant, RunID: id.RunID, NodeID: id.NodeID,
			IdempotencyKey: key, Tool: name, ArgumentsJSON: string(raw), Why: g.why, ExpiresAt: capAt})
		if err != nil {
			return "", nil, storeStatus(ctx, "approval request", err)
		}
		if !req.ExpiresAt.IsZero() {
			capAt = req.ExpiresAt // the first request's cap stands: the run's deadline does not move
		}
		ev := func(a store.Approval, state string) {
			g := &meshv1.ApprovalGate{State: state, Tool: name, Why: a.Why, DecidedBy: a.DecidedBy, Reason: a.Reason}
			if !capAt.IsZero() {
				g.ExpiresAt = timestamppb.New(capAt)
			}
			event(&meshv1.NodeEvent{Kind: &meshv1.NodeEvent_Approval{Approval: g}})
		}
		ev(req, gateWaiting)
		a, err := s.awaitDecision(ctx, req, capAt)
		if err != nil {
			return "", nil, err
		}
		switch a.State {
		case store.ApprovalApproved:
			s.approvals.WithLabelValues(gateApproved).Inc()
			ev(a, gateApproved)
			return exec(ctx)
		case store.ApprovalDenied:
			s.approvals.WithLabelValues(gateDenied).Inc()
			ev(a, gateDenied)
			msg := fmt.Sprintf("tool %s was denied by %s, not run", name, a.DecidedBy)
			if a.Reason != "" {
				msg += ": " + a.Reason
			}
			return "", nil, status.Error(codes.FailedPrecondition, msg)
		case store.ApprovalTimedOut:
			s.approvals.WithLabelValues(gateTimeout).Inc()
			ev(a, gateTimeout)
			return "", nil, approvalTimeout{status.Newf(codes.FailedPrecondition,
				"tool %s was denied, not run: no approval came before its wait's cap %s (the run's deadline less the tool's minimum time %v): approval_timeout",
				name, capAt.UTC().Format(time.RFC3339Nano), g.minTime)}
		default: // cancelled
			s.approvals.WithLabelValues(gateCancelled).Inc()
			ev(a, gateCancelled)
			if err := ctx.Err(); err != nil {
				return "", nil, status.FromContextError(err).Err()
			}
			return "", nil, status.Errorf(codes.Canceled, "tool %s: its approval request was cancelled, not run", name)
		}
	}
}

// awaitDecision polls the request until it is no longer pending, marking it timed out at
// capAt (zero: no cap) and cancelled when ctx is cancelled with a known cause. It
// returns the request as it ended, or ctx's error for a caller that went away.
func (s *Server) awaitDecision(ctx context.Context, a store.Approval, capAt time.Time) (store.Approval, error) {
	poll := s.cfg.ApprovalPoll
	if poll <= 0 {
		poll = DefaultApprovalPoll
	}
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		if a.State != store.ApprovalPending {
			return a, nil
		}
		wait := poll
		if !capAt.IsZero() {
			left := time.Until(capAt)
			if left <= 0 {
				// The cap: end the request, unless a decision came first (it stands).
				ended, _, err := s.cfg.Store.EndApproval(context.WithoutCancel(ctx), a.Tenant, a.RunID, a.NodeID, a.IdempotencyKey, store.ApprovalTimedOut)
				if err != nil {
					return a, storeStatus(ctx, "approval request", err)
				}
				return ended, nil
			}
			wait = min(wait, left)
		}
		t.Reset(wait)
		select {
		case <-ctx.Done():
			switch cancel.CauseOf(ctx) {
			case meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED, meshv1.CancelCause_CANCEL_CAUSE_SUPERSEDED:
				// The caller went away, or a newer attempt of the run replaced this one
				// (a takeover): left pending, for the call sent again to find.
				return a, status.FromContextError(ctx.Err()).Err()
			}
			ended, _, err := s.cfg.Store.EndApproval(context.WithoutCancel(ctx), a.Tenant, a.RunID, a.NodeID, a.IdempotencyKey, store.ApprovalCancelled)
			if err != nil || ended.State == store.ApprovalCancelled {
				return a, status.FromContextError(ctx.Err()).Err()
			}
			return ended, nil // decided just before: reported, but not run (ctx is done)
		case <-t.C:
		}
		cur, err := s.cfg.Store.GetApproval(ctx, a.Tenant, a.RunID, a.NodeID, a.IdempotencyKey)
		if err != nil {
			if ctx.Err() != nil {
				continue // the select above says why
			}
			return a, storeStatus(ctx, "approval request", err)
		}
		a = cur
	}
}

// storeStatus is a store error as the call's status: a store that is down is
// UNAVAILABLE, never its text.
func storeStatus(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	if c := store.Code(err); c != codes.Internal && c != codes.Unknown && c != codes.Unavailable {
		return status.Errorf(c, "%s: %v", what, err)
	}
	return status.Errorf(codes.Unavailable, "%s: the store is unavailable", what)
}
