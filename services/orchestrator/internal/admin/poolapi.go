package admin

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// pool checks that a pool method can act on name, and returns the pools.
func (s *Server) pool(name string) (Pools, error) {
	if s.cfg.Pools == nil {
		return nil, status.Error(codes.FailedPrecondition, "admission is off on this orchestrator (--admission-off): it has no pools")
	}
	if name == "" {
		return nil, invalid("pool is required")
	}
	if !s.cfg.Pools.Pool(name) {
		return nil, status.Errorf(codes.NotFound, "no pool %q is configured (see curfew status)", name)
	}
	return s.cfg.Pools, nil
}

// stateOf is name's state on this replica after the controls were applied again. A
// failed refresh is logged: the change is in the store and the next poll applies it.
func (s *Server) stateOf(ctx context.Context, pools Pools, name string) *adminv1.PoolState {
	if err := pools.Refresh(ctx); err != nil {
		s.cfg.Log.WarnContext(ctx, "pool controls not applied at once: the next poll will", "pool", name, "error", err.Error())
	}
	for _, ps := range pools.PoolStates() {
		if ps.GetPool() == name {
			return ps
		}
	}
	return &adminv1.PoolState{Pool: name, Replica: s.cfg.Replica}
}

// ClosePool implements adminv1.AdminServiceServer.
func (s *Server) ClosePool(ctx context.Context, req *adminv1.ClosePoolRequest) (*adminv1.ClosePoolResponse, error) {
	pools, err := s.pool(req.GetPool())
	if err != nil {
		return nil, err
	}
	if _, _, err := s.cfg.Store.PutControl(ctx, store.Control{Kind: store.ControlPoolClosed, Target: req.GetPool(),
		Reason: req.GetReason(), Actor: actor(ctx)}); err != nil {
		return nil, storeErr(err)
	}
	if err := s.audit(ctx, "ClosePool", "pool "+req.GetPool(), req.GetReason(), req); err != nil {
		return nil, err
	}
	return &adminv1.ClosePoolResponse{Pool: s.stateOf(ctx, pools, req.GetPool())}, nil
}

// OpenPool implements adminv1.AdminServiceServer.
func (s *Server) OpenPool(ctx context.Context, req *adminv1.OpenPoolRequest) (*adminv1.OpenPoolResponse, error) {
	pools, err := s.pool(req.GetPool())
	if err != nil {
		return nil, err
	}
	if err := s.open(ctx, pools, req.GetPool(), req.GetReason(), req.GetForce()); err != nil {
		return nil, err
	}
	if err := s.audit(ctx, "OpenPool", "pool "+req.GetPool(), req.GetReason(), req); err != nil {
		return nil, err
	}
	return &adminv1.OpenPoolResponse{Pool: s.stateOf(ctx, pools, req.GetPool())}, nil
}

// open lifts the operators' close of pool and, with force, lifts its automatic window
// for one window's length.
func (s *Server) open(ctx context.Context, pools Pools, pool, reason string, force bool) error {
	if _, _, err := s.cfg.Store.DeleteControl(ctx, store.ControlPoolClosed, pool); err != nil {
		return storeErr(err)
	}
	if !force {
		return nil
	}
	_, _, err := s.cfg.Store.PutControl(ctx, store.Control{Kind: store.ControlPoolForcedOpen, Target: pool, Reason: reason,
		Actor: actor(ctx), Until: time.Now().Add(pools.FailClosedWindow())})
	return storeErr(err)
}

// ReopenPool implements adminv1.AdminServiceServer: it reads the orphan tokens in the
// ledger (every replica's) each poll, restarts its quiet period whenever they grew,
// and opens the pool (as OpenPool without force) once they have not grown for the
// window. It reports after every poll.
func (s *Server) ReopenPool(req *adminv1.ReopenPoolRequest, stream adminv1.AdminService_ReopenPoolServer) error {
	ctx := stream.Context()
	pools, err := s.pool(req.GetPool())
	if err != nil {
		return err
	}
	window := req.GetWindow().AsDuration()
	if req.GetWindow() == nil || window <= 0 {
		return invalid("window is required and must be positive: how long the orphan delta must stay zero")
	}
	poll := s.cfg.ReopenPoll
	if poll <= 0 {
		poll = min(time.Second, max(window/4, 50*time.Millisecond))
	}
	orphans := func() (int64, error) {
		n, err := s.cfg.Store.SumTokens(ctx, store.TokenQuery{Kind: store.KindOrphan})
		if err != nil {
			return 0, storeErr(err)
		}
		return n, nil
	}
	last, err := orphans()
	if err != nil {
		return err
	}
	quietSince := time.Now()
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-t.C:
		}
		n, err := orphans()
		if err != nil {
			return err
		}
		delta := n - last
		if delta > 0 {
			last, quietSince = n, time.Now()
		}
		quiet := time.Since(quietSince)
		rep := &adminv1.ReopenPoolResponse{OrphanDelta: delta, QuietFor: durationpb.New(quiet)}
		if quiet >= window {
			if err := s.open(ctx, pools, req.GetPool(), req.GetReason(), false); err != nil {
				return err
			}
			if err := s.audit(ctx, "ReopenPool", "pool "+req.GetPool(), req.GetReason(), req); err != nil {
				return err
			}
			rep.Opened, rep.Pool = true, s.stateOf(ctx, pools, req.GetPool())
			return stream.Send(rep)
		}
		rep.Pool = s.stateOf(ctx, pools, req.GetPool())
		if err := stream.Send(rep); err != nil {
			return err
		}
	}
}
