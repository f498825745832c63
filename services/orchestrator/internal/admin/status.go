package admin

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// DefaultOrphanWindow is the window of StatusResponse.orphan_delta when admission is
// off; otherwise it is the automatic fail-closed window (fail_closed_window, 1 min by
// default), so that status's orphan delta and the overflow pool's automatic close
// judge the same stretch of time.
const DefaultOrphanWindow = time.Minute

// Status implements adminv1.AdminServiceServer: the pools, breakers and coordinated
// limits as this replica sees them, the decoders, breakers and coordinated limits of
// every modelproxy replica, and from the store the orphan
// delta, the dead-letter depth, the controls in force and every replica's
// configuration versions. A part whose source fails is left out and named in
// unreachable, so that status answers while the mesh is in trouble, which is when it
// is read.
func (s *Server) Status(ctx context.Context, _ *adminv1.StatusRequest) (*adminv1.StatusResponse, error) {
	out := &adminv1.StatusResponse{Replica: s.cfg.Replica, OrphanWindow: durationpb.New(s.orphanWindow())}
	if s.cfg.Pools != nil {
		out.Pools = s.cfg.Pools.PoolStates()
		s.clusterView(ctx, out)
	}
	if s.cfg.Breakers != nil {
		for _, b := range s.cfg.Breakers.All() {
			out.Breakers = append(out.Breakers, &adminv1.BreakerState{Service: "orchestrator", Replica: s.cfg.Replica,
				Target: b.Target(), State: b.State().Name()})
		}
	}
	out.Coordination = s.ownCoordination(time.Now())
	v := s.fleet(ctx, 0)
	out.Leases, out.Breakers, out.Unreachable = v.leases, append(out.Breakers, v.breakers...), v.unreachable
	out.Coordination = append(out.Coordination, v.coordination...)
	storeFailed := func(what string, err error) {
		s.cfg.Log.WarnContext(ctx, "status: part not read", "part", what, "error", err.Error())
		out.Unreachable = append(out.Unreachable, "store ("+what+")")
	}
	if n, err := s.cfg.Store.SumTokens(ctx, store.TokenQuery{Kind: store.KindOrphan, Since: time.Now().Add(-s.orphanWindow())}); err != nil {
		storeFailed("orphan delta", err)
	} else {
		out.OrphanDelta = n
	}
	if n, err := s.cfg.Store.DeadLetterDepth(ctx, ""); err != nil {
		storeFailed("dead letters", err)
	} else {
		out.DeadLetterDepth = n
	}
	if cs, err := s.cfg.Store.ListReplicaConfigs(ctx, ""); err != nil {
		storeFailed("replica configs", err)
	} else {
		for _, c := range cs {
			rc := &adminv1.ReplicaConfig{Service: c.Service, Replica: c.Replica, Config: c.Config, Version: c.Version,
				LastError: c.LastError, LoadedAt: timestamppb.New(c.LoadedAt), SeenAt: timestamppb.New(c.SeenAt)}
			out.Configs = append(out.Configs, rc)
		}
	}
	if freezes, drains, err := s.controlsView(ctx); err != nil {
		storeFailed("controls", err)
	} else {
		out.Freezes, out.Drains = freezes, drains
	}
	return out, nil
}

// clusterView adds cluster-wide admission to out: this replica's coordination state,
// and each pool's slots held across the cluster, read from the store.
func (s *Server) clusterView(ctx context.Context, out *adminv1.StatusResponse) {
	cv, ok := s.cfg.Pools.(interface {
		ClusterStatus() admission.ClusterStatus
	})
	if !ok {
		return
	}
	cs := cv.ClusterStatus()
	out.Cluster = &adminv1.ClusterAdmission{Enabled: cs.Enabled, Degraded: cs.Degraded, LastError: cs.LastError,
		Replicas: count32(cs.Replicas), LocalAdmits: cs.LocalAdmits, SlotsLost: cs.SlotsLost, Holder: cs.Holder.Name}
	if cs.Degraded {
		out.Cluster.DegradedSince = timestamppb.New(cs.DegradedSince)
	}
	if cs.LastError == "" && cs.Holder.RenewError != nil {
		out.Cluster.LastError = cs.Holder.RenewError.Error()
	}
	if !cs.Holder.LastRenew.IsZero() {
		out.Cluster.LastRenew = timestamppb.New(cs.Holder.LastRenew)
	}
	if !cs.Enabled {
		return
	}
	now := time.Now()
	for _, p := range out.Pools {
		slots, err := s.cfg.Store.ListSlots(ctx, admission.PoolScope(p.GetPool()))
		if err != nil {
			p.ClusterInFlight = -1
			continue
		}
		for _, sl := range slots {
			if sl.Held(now) {
				p.ClusterInFlight++
			}
		}
	}
}

func (s *Server) orphanWindow() time.Duration {
	if s.cfg.Pools != nil {
		if w := s.cfg.Pools.FailClosedWindow(); w > 0 {
			return w
		}
	}
	return DefaultOrphanWindow
}
