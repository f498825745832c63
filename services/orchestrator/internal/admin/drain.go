package admin

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Decoder drains (`curfew decoders drain|undrain`). A drain is a store.ControlDrain
// whose target is a pool, or store.DrainAll for every run; every modelproxy replica
// polls it and refuses new decoders of the runs it covers (a run's pool travels as
// curfew-pool), lets the running ones end, and cancels those still running at its
// cancel-at (Until) with cause operator.

// drainTarget is the control target of a drain request's pool: DrainAll for "".
func (s *Server) drainTarget(pool string) (string, error) {
	if pool == "" {
		return store.DrainAll, nil
	}
	if !md.ValidPool(pool) {
		return "", invalid("pool %q must be 1 to %d characters of A-Z a-z 0-9 . _ -", pool, md.MaxPoolLen)
	}
	if s.cfg.Pools != nil && !s.cfg.Pools.Pool(pool) {
		return "", invalid("pool %q is not a configured admission pool", pool)
	}
	return pool, nil
}

func drainScope(target string) string {
	if target == store.DrainAll {
		return "decoders of every run"
	}
	return "decoders of pool " + target
}

// drainOf is a drain control as operators see it.
func drainOf(c store.Control) *adminv1.Drain {
	d := &adminv1.Drain{Pool: c.Target, Reason: c.Reason, Actor: c.Actor, StartedAt: timestamppb.New(c.CreatedAt)}
	if c.Target == store.DrainAll {
		d.Pool = ""
	}
	if !c.Until.IsZero() {
		d.CancelAt = timestamppb.New(c.Until)
	}
	return d
}

// DrainDecoders implements adminv1.AdminServiceServer. Repeating it keeps the first
// drain's instant and actor and takes the new reason and cancel-at (cancel_after from
// now; unset: let the running decoders end); each call is audited.
func (s *Server) DrainDecoders(ctx context.Context, req *adminv1.DrainDecodersRequest) (*adminv1.DrainDecodersResponse, error) {
	target, err := s.drainTarget(req.GetPool())
	if err != nil {
		return nil, err
	}
	after, err := optionalAge("cancel_after", req.GetCancelAfter())
	if err != nil {
		return nil, err
	}
	c := store.Control{Kind: store.ControlDrain, Target: target, Reason: req.GetReason(), Actor: actor(ctx)}
	if after > 0 {
		c.Until = time.Now().Add(after)
	}
	got, _, err := s.cfg.Store.PutControl(ctx, c)
	if err != nil {
		return nil, storeErr(err)
	}
	if err := s.audit(ctx, "DrainDecoders", drainScope(target), req.GetReason(), req); err != nil {
		return nil, err
	}
	return &adminv1.DrainDecodersResponse{Drain: drainOf(got)}, nil
}

// UndrainDecoders implements adminv1.AdminServiceServer: undrained says whether a drain
// was in force. A drain of every run and a pool's drain are lifted separately.
func (s *Server) UndrainDecoders(ctx context.Context, req *adminv1.UndrainDecodersRequest) (*adminv1.UndrainDecodersResponse, error) {
	target := store.DrainAll
	if p := req.GetPool(); p != "" {
		if !md.ValidPool(p) {
			return nil, invalid("pool %q must be 1 to %d characters of A-Z a-z 0-9 . _ -", p, md.MaxPoolLen)
		}
		target = p // a pool no longer configured may still be undrained
	}
	_, undrained, err := s.cfg.Store.DeleteControl(ctx, store.ControlDrain, target)
	if err != nil {
		return nil, storeErr(err)
	}
	if err := s.audit(ctx, "UndrainDecoders", drainScope(target), req.GetReason(), req); err != nil {
		return nil, err
	}
	return &adminv1.UndrainDecodersResponse{Undrained: undrained}, nil
}
