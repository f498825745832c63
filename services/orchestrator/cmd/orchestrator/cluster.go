package main

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/clusterslots"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// clusterAdmission makes admission's pool caps and tenant concurrency cluster-wide on a
// shared store (docs/cluster.md): one slot holder for the process, and the count of live
// orchestrators for the local share of each cap while the store is down.
type clusterAdmission struct {
	holder   *clusterslots.Holder
	replicas atomic.Int64
	ctl      atomic.Pointer[admission.Controller]
}

// newClusterAdmission starts the slot holder on st. fixed, when positive, is the replica
// count of the degraded share (--cluster-replicas); else it is counted from the
// replicas' rows in st (service.LiveReplicas; self is this replica's name there),
// refreshed every ReplicaRefresh, the last count kept while the store fails.
func newClusterAdmission(ctx context.Context, st store.Store, self string, ttl time.Duration, fixed int, log *slog.Logger) (*clusterAdmission, error) {
	ca := &clusterAdmission{}
	ca.replicas.Store(1)
	h, err := clusterslots.New(clusterslots.Config{Store: st, TTL: ttl, Logger: log, //nolint:contextcheck // its loops serve the process until close, not this call

		OnRelease: func(scope string) {
			if c := ca.ctl.Load(); c != nil {
				c.Kick(scope)
			}
		},
		OnRenewError: func(err error) { log.Warn("renewing cluster-wide admission slots", "error", err.Error()) }})
	if err != nil {
		return nil, err
	}
	ca.holder = h
	if fixed > 0 {
		ca.replicas.Store(int64(fixed))
		return ca, nil
	}
	count := func() {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		if n, err := service.LiveReplicas(cctx, st, "orchestrator", self); err == nil {
			ca.replicas.Store(int64(n))
		}
	}
	go func() {
		count()
		t := time.NewTicker(service.ReplicaRefresh)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				count()
			}
		}
	}()
	return ca, nil
}

// config is admission's wiring to the holder.
func (ca *clusterAdmission) config() admission.ClusterConfig {
	return admission.ClusterConfig{Slots: ca.holder, Replicas: func() int { return int(ca.replicas.Load()) }}
}

// attach routes the holder's release notices to c.
func (ca *clusterAdmission) attach(c *admission.Controller) { ca.ctl.Store(c) }

// close gives back every slot still held (the runs handed over at a drain).
func (ca *clusterAdmission) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = ca.holder.Close(ctx)
}
