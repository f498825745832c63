package modelproxy

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// The operators' controls over decoders (docs/operations.md, "Leases, the ledger and
// decoders"): a ledger freeze of a run or a tenant, and a drain of a pool's runs or of
// every run. They are rows of the store (store.Operators), written by the orchestrator's
// admin API; each replica polls them (WatchControls), so a command sent to one
// orchestrator holds on every modelproxy within a poll interval. A replica on a private
// store reads its own.
//
//   - A freeze cancels the frozen scope's running decoders with cause operator (their
//     tokens after the cancel are orphans in the ledger, as for any cancel) and refuses a
//     new Generate of it with FAILED_PRECONDITION, ErrorInfo LEDGER_FROZEN.
//   - A drain refuses a new Generate of its scope with FAILED_PRECONDITION, ErrorInfo
//     DECODERS_DRAINED, and lets the running ones go on; from its Until (cancel-at), when
//     set, those still running are cancelled with cause operator.
//
// Both refusals come before any decoder, node, lease or budget reservation: FAILED_
// PRECONDITION is not retried by the client chain, and the breakers count it as the
// target's answer, never as its failure (breaker.Classify); no provider breaker sees it.

// ErrorInfo reasons of the controls' refusals (domain curfew.dev).
const (
	// ReasonLedgerFrozen: the call's run or tenant is frozen (`curfew ledger freeze`).
	ReasonLedgerFrozen = "LEDGER_FROZEN"
	// ReasonDecodersDrained: the call's pool, or every run, is drained (`curfew decoders
	// drain`).
	ReasonDecodersDrained = "DECODERS_DRAINED"
)

const (
	// DefaultControlsPoll is how often WatchControls reads the controls by default.
	DefaultControlsPoll = 500 * time.Millisecond
	// MaxControlsPoll is the longest poll interval allowed: a freeze holds on every
	// replica within a second.
	MaxControlsPoll = time.Second
	// controlsTimeout bounds one read of the controls.
	controlsTimeout = 2 * time.Second
)

// ValidateControlsPoll checks a --controls-poll value: positive, at most MaxControlsPoll.
func ValidateControlsPoll(d time.Duration) error {
	if d <= 0 || d > MaxControlsPoll {
		return fmt.Errorf("must be more than 0 and at most %v, got %v", MaxControlsPoll, d)
	}
	return nil
}

// ControlLister reads the operators' controls: store.Operators.ListControls.
type ControlLister interface {
	ListControls(ctx context.Context) ([]store.Control, error)
}

// controlSet is the controls a replica last read, indexed for Generate's check.
type controlSet struct {
	runs     map[[2]string]store.Control // (tenant, run) → freeze; tenant "" matches any
	tenants  map[string]store.Control    // tenant → freeze
	pools    map[string]store.Control    // pool → drain
	drainAll *store.Control
}

func newControlSet(cs []store.Control) *controlSet {
	set := &controlSet{runs: map[[2]string]store.Control{}, tenants: map[string]store.Control{}, pools: map[string]store.Control{}}
	for _, c := range cs {
		switch c.Kind {
		case store.ControlFreezeRun:
			set.runs[[2]string{c.Tenant, c.Target}] = c
		case store.ControlFreezeTenant:
			set.tenants[c.Target] = c
		case store.ControlDrain:
			if c.Target == store.DrainAll {
				set.drainAll = &c
			} else {
				set.pools[c.Target] = c
			}
		}
	}
	return set
}

// freeze returns the freeze covering a call of tenant's run, if any.
func (c *controlSet) freeze(tenant, run string) (store.Control, bool) {
	if c == nil {
		return store.Control{}, false
	}
	if f, ok := c.runs[[2]string{tenant, run}]; ok {
		return f, true
	}
	if f, ok := c.runs[[2]string{"", run}]; ok {
		return f, true
	}
	f, ok := c.tenants[tenant]
	return f, ok
}

// drain returns the drain covering a call of a run of pool ("" when unknown: only a
// drain of every run covers it), if any.
func (c *controlSet) drain(pool string) (store.Control, bool) {
	if c == nil {
		return store.Control{}, false
	}
	if c.drainAll != nil {
		return *c.drainAll, true
	}
	if pool == "" {
		return store.Control{}, false
	}
	d, ok := c.pools[pool]
	return d, ok
}

// refuse returns the refusal of a new decoder for tenant's run of pool under the
// controls in force, or nil.
func (s *Server) refuse(tenant, run, pool string) error {
	set := s.controls.Load()
	if f, ok := set.freeze(tenant, run); ok {
		scope, what := "run", fmt.Sprintf("run %s of tenant %s", run, tenant)
		if f.Kind == store.ControlFreezeTenant {
			scope, what = "tenant", "tenant "+tenant
		}
		msg := fmt.Sprintf("ledger frozen: %s is frozen by an operator since %s%s: no decoder starts for it until it is thawed (curfew ledger thaw)",
			what, f.CreatedAt.UTC().Format(time.RFC3339), because(f.Reason))
		return controlErr(msg, ReasonLedgerFrozen, map[string]string{
			"scope": scope, "tenant": tenant, "run_id": run, "frozen_at": f.CreatedAt.UTC().Format(time.RFC3339Nano),
		})
	}
	if d, ok := set.drain(pool); ok {
		what := "every run"
		if d.Target != store.DrainAll {
			what = "the runs of pool " + d.Target
		}
		msg := fmt.Sprintf("decoders drained: no new decoder starts for %s since %s%s, until they are undrained (curfew decoders undrain)",
			what, d.CreatedAt.UTC().Format(time.RFC3339), because(d.Reason))
		return controlErr(msg, ReasonDecodersDrained, map[string]string{"pool": d.Target, "drained_at": d.CreatedAt.UTC().Format(time.RFC3339Nano)})
	}
	return nil
}

func because(reason string) string {
	if reason == "" {
		return ""
	}
	return " (" + reason + ")"
}

func controlErr(msg, reason string, meta map[string]string) error {
	st := status.New(codes.FailedPrecondition, msg)
	if ws, err := st.WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: "curfew.dev", Metadata: meta}); err == nil {
		st = ws
	}
	return st.Err()
}

// WatchControls reads the controls from src now and every interval (DefaultControlsPoll
// when not positive) until ctx ends, and applies them to the decoders after each read: a
// frozen scope's running decoders are cancelled with cause operator, and so are those a
// drain covers once its Until has passed. A read that fails keeps the controls last read
// (logged once until a read succeeds again): a store hiccup neither lifts a freeze nor
// invents one.
func (s *Server) WatchControls(ctx context.Context, src ControlLister, interval time.Duration) {
	if interval <= 0 {
		interval = DefaultControlsPoll
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	failing := false
	for {
		rctx, cancelRead := context.WithTimeout(ctx, controlsTimeout)
		cs, err := src.ListControls(rctx)
		cancelRead()
		switch {
		case err != nil && ctx.Err() == nil:
			if !failing {
				s.log().WarnContext(ctx, "cannot read the operators' controls; keeping the last read", "error", err.Error())
			}
			failing = true
		case err == nil:
			if failing {
				s.log().InfoContext(ctx, "reading the operators' controls again")
			}
			failing = false
			s.applyControls(ctx, newControlSet(cs))
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// applyControls makes set the controls in force and stops the decoders it covers.
func (s *Server) applyControls(ctx context.Context, set *controlSet) {
	s.controls.Store(set)
	now := s.now()
	for _, d := range s.decoders.list(nil) {
		f, frozen := set.freeze(d.tenant, d.run)
		dr, drained := set.drain(d.pool)
		var why string
		switch {
		case frozen:
			why = "ledger frozen" + because(f.Reason)
		case drained && !dr.Until.IsZero() && !now.Before(dr.Until):
			why = "decoders drained, cancel-at passed" + because(dr.Reason)
		default:
			continue
		}
		if s.stopDecoder(d, cancel.ErrOperator) {
			s.log().InfoContext(ctx, "decoder cancelled by an operator's control", "why", why,
				"tenant", d.tenant, "run_id", d.run, "node_id", d.node, "pool", d.pool)
		}
	}
}
