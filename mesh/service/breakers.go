package service

import (
	"context"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// BreakerStore is what CoordinateBreakers needs of a store.
type BreakerStore interface {
	store.Slots
	store.Sharing
}

// CoordinateBreakers makes the half-open probes of rt.Breakers, and of the other sets
// given (modelproxy's provider breakers), cluster-wide through st until ctx ends
// (breaker.Set.Coordinate; docs/cluster.md, "One probe per dependency"), when
// --breaker-coordination is store (the default) and st is shared with other processes.
// Otherwise each replica's breakers probe on their own. It reports whether it
// coordinated them.
func (rt *Runtime) CoordinateBreakers(ctx context.Context, st BreakerStore, sets ...*breaker.Set) (bool, error) {
	if !rt.Opts.Breaker.Coordinated() || st == nil || !st.Shared() {
		return false, nil
	}
	for _, s := range append([]*breaker.Set{rt.Breakers}, sets...) {
		if s == nil || s.Config().Off {
			continue
		}
		if err := s.Coordinate(ctx, breaker.Coordination{Store: st}); err != nil {
			return false, err
		}
	}
	rt.Log.Info("circuit breakers: one half-open probe per target across replicas, through the store")
	return true, nil
}
