package admin

import (
	"context"
	"log/slog"
	"math"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// DefaultControlsPoll is how often an orchestrator reads the operators' pool controls
// from the store: a close or open made through one replica holds on every replica
// within it.
const DefaultControlsPoll = 500 * time.Millisecond

// PoolControls keeps one replica's admission controller obeying the operators' pool
// controls in the store (pool_closed, pool_forced_open), and shows the pools as that
// replica sees them. It implements Pools.
type PoolControls struct {
	st      store.Operators
	ctrl    *admission.Controller
	replica string
	log     *slog.Logger

	mu   sync.Mutex
	last map[string]store.Control // the pool controls last applied, by kind/target
}

// NewPoolControls returns the pool controls of ctrl, read from st. replica names this
// orchestrator in PoolStates; log (nil: slog.Default()) receives failed reads.
func NewPoolControls(st store.Operators, ctrl *admission.Controller, replica string, log *slog.Logger) *PoolControls {
	if log == nil {
		log = slog.Default()
	}
	return &PoolControls{st: st, ctrl: ctrl, replica: replica, log: log, last: map[string]store.Control{}}
}

// Run applies the controls every period (0: DefaultControlsPoll) until ctx ends. A
// failed read keeps the controls last applied and is logged once until a read works.
func (p *PoolControls) Run(ctx context.Context, period time.Duration) {
	if period <= 0 {
		period = DefaultControlsPoll
	}
	t := time.NewTicker(period)
	defer t.Stop()
	failing := false
	for {
		err := p.Refresh(ctx)
		switch {
		case err != nil && !failing && ctx.Err() == nil:
			p.log.WarnContext(ctx, "operators' pool controls not read: keeping the last ones", "error", err.Error())
			failing = true
		case err == nil && failing:
			p.log.InfoContext(ctx, "operators' pool controls read again")
			failing = false
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Refresh reads the controls from the store and applies them now.
func (p *PoolControls) Refresh(ctx context.Context) error {
	cs, err := p.st.ListControls(ctx)
	if err != nil {
		return err
	}
	oc := admission.OperatorControls{Closed: map[string]string{}, ForcedOpen: map[string]time.Time{}}
	last := map[string]store.Control{}
	for _, c := range cs {
		switch c.Kind {
		case store.ControlPoolClosed:
			oc.Closed[c.Target] = c.Reason
		case store.ControlPoolForcedOpen:
			oc.ForcedOpen[c.Target] = c.Until
		default:
			continue
		}
		last[string(c.Kind)+"/"+c.Target] = c
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ctrl.SetOperatorControls(oc)
	p.last = last
	return nil
}

// Pool reports whether name is a configured pool.
func (p *PoolControls) Pool(name string) bool {
	for _, s := range p.ctrl.PoolStates() {
		if s.Name == name {
			return true
		}
	}
	return false
}

// FailClosedWindow is how long an open with force lifts the automatic window.
func (p *PoolControls) FailClosedWindow() time.Duration { return p.ctrl.FailClosedWindow() }

// PoolStates returns every configured pool as this replica sees it.
func (p *PoolControls) PoolStates() []*adminv1.PoolState {
	p.mu.Lock()
	last := p.last
	p.mu.Unlock()
	var out []*adminv1.PoolState
	for _, s := range p.ctrl.PoolStates() {
		ps := &adminv1.PoolState{Pool: s.Name, Overflow: s.Overflow, Replica: p.replica,
			InFlight: count32(s.InFlight), Queued: count32(s.Queued), MaxInFlight: count32(s.MaxInFlight), MaxQueue: count32(s.MaxQueue),
			OperatorClosed: s.OperatorClosed, OperatorReason: s.OperatorReason,
			AutoClosed: len(s.AutoConditions) > 0 && s.ForcedOpenUntil.IsZero(), AutoConditions: s.AutoConditions}
		if s.OldestQueued > 0 {
			ps.OldestQueued = durationpb.New(s.OldestQueued)
		}
		if !s.AutoUntil.IsZero() {
			ps.AutoClosedUntil = timestamppb.New(s.AutoUntil)
		}
		if !s.ForcedOpenUntil.IsZero() {
			ps.ForcedOpenUntil = timestamppb.New(s.ForcedOpenUntil)
		}
		if c, ok := last[string(store.ControlPoolClosed)+"/"+s.Name]; ok && s.OperatorClosed {
			ps.OperatorActor, ps.OperatorClosedAt = c.Actor, timestamppb.New(c.CreatedAt)
		}
		out = append(out, ps)
	}
	return out
}

// ClusterStatus is the state of this replica's cluster-wide admission.
func (p *PoolControls) ClusterStatus() admission.ClusterStatus { return p.ctrl.ClusterStatus() }

// count32 is a count for an int32 field, clamped: a pool's limits are configured ints.
func count32(n int) int32 {
	return int32(min(max(n, 0), math.MaxInt32)) //nolint:gosec // clamped to int32's range on the line itself
}

var _ Pools = (*PoolControls)(nil)
