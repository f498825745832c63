package admin

import (
	"context"
	"errors"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Ledger freezes (`curfew ledger freeze|thaw|ls`). A freeze is a control in the store
// (store.ControlFreezeRun or store.ControlFreezeTenant); every modelproxy replica polls
// the controls, cancels the frozen scope's decoders with cause operator and starts no new
// one for it (services/modelproxy/internal/modelproxy/controls.go). Tokens the ledger
// records for the scope after the freeze are its orphans: decoders that had not stopped
// yet.

// freezeScope is what a freeze request names: a tenant's run, or a whole tenant.
type freezeScope struct {
	tenant, run string
}

func (f freezeScope) kind() store.ControlKind {
	if f.run != "" {
		return store.ControlFreezeRun
	}
	return store.ControlFreezeTenant
}

func (f freezeScope) target() string {
	if f.run != "" {
		return f.run
	}
	return f.tenant
}

func (f freezeScope) String() string {
	if f.run != "" {
		return "run " + f.run + " of tenant " + f.tenant
	}
	return "tenant " + f.tenant
}

// validRunID is the wire contract's rule of a run id (md: curfew-run-id).
func validRunID(s string) bool {
	if s == "" || len(s) > md.MaxIDLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && (c < '0' || c > '9') && c != '.' && c != '_' && c != ':' && c != '-' {
			return false
		}
	}
	return true
}

// scope validates a freeze or thaw request's run_id and tenant, checks that a run named
// with its tenant exists, and resolves a run named without its tenant: the tenant that
// has it (run ids are minted unique, so more than one is a store imported from
// elsewhere, and the operator must name one).
//
// A thaw (exists false) does not check that a run named with its tenant exists: a freeze
// may outlive its run's record.
func (s *Server) scope(ctx context.Context, runID, tenant string, exists bool) (freezeScope, error) {
	if runID == "" && tenant == "" {
		return freezeScope{}, invalid("run_id or tenant is required: a run (with its tenant, or alone when its id is unique) or a whole tenant")
	}
	if tenant != "" && !md.ValidTenant(tenant) {
		return freezeScope{}, invalid("tenant %q must be 1 to %d characters of A-Z a-z 0-9 . _ -", tenant, md.MaxTenantLen)
	}
	if runID == "" {
		return freezeScope{tenant: tenant}, nil
	}
	if !validRunID(runID) {
		return freezeScope{}, invalid("run_id %q must be 1 to %d characters of A-Z a-z 0-9 . _ : -", runID, md.MaxIDLen)
	}
	if tenant != "" && !exists {
		return freezeScope{tenant: tenant, run: runID}, nil
	}
	if tenant != "" {
		// A run named with the wrong tenant would freeze nothing: say so instead.
		if _, err := s.cfg.Store.GetRun(ctx, tenant, runID); err != nil {
			if errors.Is(err, store.ErrNotFound) {
				return freezeScope{}, status.Errorf(codes.NotFound, "run_id: no run %s of tenant %s", runID, tenant)
			}
			return freezeScope{}, storeErr(err)
		}
		return freezeScope{tenant: tenant, run: runID}, nil
	}
	tenants, err := s.runTenants(ctx, runID)
	if err != nil {
		return freezeScope{}, err
	}
	switch len(tenants) {
	case 0:
		return freezeScope{}, status.Errorf(codes.NotFound, "run_id %s: no tenant has such a run; name its tenant with tenant", runID)
	case 1:
		return freezeScope{tenant: tenants[0], run: runID}, nil
	}
	return freezeScope{}, invalid("run_id %s names a run of several tenants (%s): name one with tenant", runID, strings.Join(tenants, ", "))
}

// runTenants returns the tenants that have a run of id runID.
func (s *Server) runTenants(ctx context.Context, runID string) ([]string, error) {
	us, err := s.cfg.Store.TenantUsage(ctx, "", time.Time{})
	if err != nil {
		return nil, storeErr(err)
	}
	var out []string
	for _, u := range us {
		if u.Runs == 0 {
			continue
		}
		_, err := s.cfg.Store.GetRun(ctx, u.Tenant, runID)
		switch {
		case err == nil:
			out = append(out, u.Tenant)
		case !errors.Is(err, store.ErrNotFound):
			return nil, storeErr(err)
		}
	}
	slices.Sort(out)
	return out, nil
}

// freezeOf is a freeze control as operators see it, with the tokens recorded for its
// scope since it was set.
func (s *Server) freezeOf(ctx context.Context, c store.Control) (*adminv1.Freeze, error) {
	f := &adminv1.Freeze{Reason: c.Reason, Actor: c.Actor, FrozenAt: timestamppb.New(c.CreatedAt)}
	// The orphan entries recorded since the freeze: the freeze cancels the scope's
	// decoders, and what each decoded after its cancel is written as orphan when it
	// ends. Its output before the freeze is not counted, though it is written then too.
	q := store.TokenQuery{Kind: store.KindOrphan, Since: c.CreatedAt}
	if c.Kind == store.ControlFreezeRun {
		f.Tenant, f.RunId = c.Tenant, c.Target
		q.Tenant, q.RunID = c.Tenant, c.Target
	} else {
		f.Tenant = c.Target
		q.Tenant = c.Target
	}
	n, err := s.cfg.Store.SumTokens(ctx, q)
	if err != nil {
		return nil, storeErr(err)
	}
	f.TokensAfterFreeze = n
	return f, nil
}

// FreezeLedger implements adminv1.AdminServiceServer. Repeating it keeps the first
// freeze (its instant and actor) and takes the new reason; each call is audited.
func (s *Server) FreezeLedger(ctx context.Context, req *adminv1.FreezeLedgerRequest) (*adminv1.FreezeLedgerResponse, error) {
	sc, err := s.scope(ctx, req.GetRunId(), req.GetTenant(), true)
	if err != nil {
		return nil, err
	}
	c := store.Control{Kind: sc.kind(), Target: sc.target(), Reason: req.GetReason(), Actor: actor(ctx)}
	if sc.run != "" {
		c.Tenant = sc.tenant
	}
	got, _, err := s.cfg.Store.PutControl(ctx, c)
	if err != nil {
		return nil, storeErr(err)
	}
	if err := s.audit(ctx, "FreezeLedger", sc.String(), req.GetReason(), req); err != nil {
		return nil, err
	}
	f, err := s.freezeOf(ctx, got)
	if err != nil {
		return nil, err
	}
	return &adminv1.FreezeLedgerResponse{Freeze: f}, nil
}

// ThawLedger implements adminv1.AdminServiceServer: thawed says whether a freeze was in
// force. Thawing what is not frozen is not an error (and is audited too).
func (s *Server) ThawLedger(ctx context.Context, req *adminv1.ThawLedgerRequest) (*adminv1.ThawLedgerResponse, error) {
	sc, err := s.scope(ctx, req.GetRunId(), req.GetTenant(), false)
	if err != nil {
		return nil, err
	}
	_, thawed, err := s.cfg.Store.DeleteControl(ctx, sc.kind(), sc.target())
	if err != nil {
		return nil, storeErr(err)
	}
	if err := s.audit(ctx, "ThawLedger", sc.String(), req.GetReason(), req); err != nil {
		return nil, err
	}
	return &adminv1.ThawLedgerResponse{Thawed: thawed}, nil
}

// ListFreezes implements adminv1.AdminServiceServer.
func (s *Server) ListFreezes(ctx context.Context, _ *adminv1.ListFreezesRequest) (*adminv1.ListFreezesResponse, error) {
	freezes, _, err := s.controlsView(ctx)
	if err != nil {
		return nil, err
	}
	return &adminv1.ListFreezesResponse{Freezes: freezes}, nil
}

// controlsView returns the freezes (with their tokens after the freeze) and drains in
// force, as operators see them: for ListFreezes and Status.
func (s *Server) controlsView(ctx context.Context) (freezes []*adminv1.Freeze, drains []*adminv1.Drain, err error) {
	cs, err := s.cfg.Store.ListControls(ctx)
	if err != nil {
		return nil, nil, storeErr(err)
	}
	for _, c := range cs {
		switch c.Kind {
		case store.ControlFreezeRun, store.ControlFreezeTenant:
			f, err := s.freezeOf(ctx, c)
			if err != nil {
				return nil, nil, err
			}
			freezes = append(freezes, f)
		case store.ControlDrain:
			drains = append(drains, drainOf(c))
		}
	}
	return freezes, drains, nil
}

// actor names the caller of ctx for a control's Actor, as the audit log does.
func actor(ctx context.Context) string {
	if a := apikey.Caller(ctx); a != "" {
		return a
	}
	return "unknown"
}
