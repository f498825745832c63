package admin

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
)

var approvalStates = map[store.ApprovalState]adminv1.ApprovalState{
	store.ApprovalPending:   adminv1.ApprovalState_APPROVAL_STATE_PENDING,
	store.ApprovalApproved:  adminv1.ApprovalState_APPROVAL_STATE_APPROVED,
	store.ApprovalDenied:    adminv1.ApprovalState_APPROVAL_STATE_DENIED,
	store.ApprovalTimedOut:  adminv1.ApprovalState_APPROVAL_STATE_TIMED_OUT,
	store.ApprovalCancelled: adminv1.ApprovalState_APPROVAL_STATE_CANCELLED,
}

func approvalProto(a store.Approval, startedBy string) *adminv1.Approval {
	out := &adminv1.Approval{Tenant: a.Tenant, RunId: a.RunID, NodeId: a.NodeID, IdempotencyKey: a.IdempotencyKey,
		Tool: a.Tool, ArgumentsJson: a.ArgumentsJSON, Why: a.Why, State: approvalStates[a.State],
		RequestedAt: timestamppb.New(a.RequestedAt), DecidedBy: a.DecidedBy, Reason: a.Reason, RunStartedBy: startedBy}
	if !a.ExpiresAt.IsZero() {
		out.ExpiresAt = timestamppb.New(a.ExpiresAt)
	}
	if !a.DecidedAt.IsZero() {
		out.DecidedAt = timestamppb.New(a.DecidedAt)
	}
	return out
}

// startedBy returns who started the tenant's run, "" when the store does not know.
func (s *Server) startedBy(ctx context.Context, tenant, runID string) string {
	r, err := s.cfg.Store.GetRun(ctx, tenant, runID)
	if err != nil {
		return ""
	}
	return r.StartedBy
}

// ListApprovals implements adminv1.AdminServiceServer: read-only.
func (s *Server) ListApprovals(ctx context.Context, req *adminv1.ListApprovalsRequest) (*adminv1.ListApprovalsResponse, error) {
	as, err := s.cfg.Store.ListApprovals(ctx, store.ApprovalQuery{PendingOnly: req.GetPendingOnly(), Tenant: req.GetTenant(), RunID: req.GetRunId()})
	if err != nil {
		return nil, storeErr(err)
	}
	out := &adminv1.ListApprovalsResponse{}
	starters := map[string]string{}
	for _, a := range as {
		k := a.Tenant + "\x00" + a.RunID
		by, ok := starters[k]
		if !ok {
			by = s.startedBy(ctx, a.Tenant, a.RunID)
			starters[k] = by
		}
		out.Approvals = append(out.Approvals, approvalProto(a, by))
	}
	return out, nil
}

// DecideApproval implements adminv1.AdminServiceServer: approves or denies the node's
// request, the first decision standing (the same decision again returns it unchanged;
// another is FAILED_PRECONDITION, as is any decision after the wait timed out or was
// cancelled). A tenant with approver_not_starter refuses the run's starter
// (PERMISSION_DENIED). Every decision that changed something is audited with its reason.
func (s *Server) DecideApproval(ctx context.Context, req *adminv1.DecideApprovalRequest) (*adminv1.DecideApprovalResponse, error) {
	switch {
	case req.GetRunId() == "":
		return nil, must("run_id")
	case req.GetNodeId() == "":
		return nil, must("node_id")
	}
	tenant, err := s.approvalTenant(ctx, req)
	if err != nil {
		return nil, err
	}
	caller := apikey.Caller(ctx)
	if caller == "" {
		caller = "unknown"
	}
	starter := s.startedBy(ctx, tenant, req.GetRunId())
	if s.cfg.Tenants != nil && s.cfg.Tenants.TenantLimits(tenant).ApproverNotStarter && starter != "" && starter == caller {
		return nil, status.Errorf(codes.PermissionDenied,
			"tenant %s requires the approver to differ from the run's starter (%s): ask another operator", tenant, starter)
	}
	a, err := s.cfg.Store.DecideApproval(ctx, store.ApprovalDecision{Tenant: tenant, RunID: req.GetRunId(), NodeID: req.GetNodeId(),
		Approve: req.GetApprove(), Actor: caller, Reason: req.GetReason()})
	if errors.Is(err, store.ErrConflict) {
		return nil, status.Errorf(codes.FailedPrecondition, "run %s node %s: the request is already %s (by %s): the first decision stands",
			req.GetRunId(), req.GetNodeId(), a.State, orNobody(a.DecidedBy))
	}
	if err != nil {
		return nil, storeErr(err)
	}
	action := "DenyApproval"
	if req.GetApprove() {
		action = "ApproveApproval"
	}
	// (A repeat of the decision is audited too, like any repeated command: see the package doc.)
	if err := s.audit(ctx, action, fmt.Sprintf("run %s node %s tool %s", a.RunID, a.NodeID, a.Tool), req.GetReason(), req); err != nil {
		return nil, err
	}
	return &adminv1.DecideApprovalResponse{Approval: approvalProto(a, starter)}, nil
}

func orNobody(s string) string {
	if s == "" {
		return "nobody: no decision came in time"
	}
	return s
}

// approvalTenant is the request's tenant, or, when it names none, the tenant of the
// run's requests when only one tenant has a run of that id.
func (s *Server) approvalTenant(ctx context.Context, req *adminv1.DecideApprovalRequest) (string, error) {
	if t := req.GetTenant(); t != "" {
		return t, nil
	}
	as, err := s.cfg.Store.ListApprovals(ctx, store.ApprovalQuery{RunID: req.GetRunId()})
	if err != nil {
		return "", storeErr(err)
	}
	tenant := ""
	for _, a := range as {
		if a.NodeID != req.GetNodeId() {
			continue
		}
		if tenant != "" && a.Tenant != tenant {
			return "", status.Errorf(codes.InvalidArgument, "run %s has approval requests in tenants %s and %s: name the tenant", req.GetRunId(), tenant, a.Tenant)
		}
		tenant = a.Tenant
	}
	if tenant == "" {
		return "", status.Errorf(codes.NotFound, "run %s node %s has no approval request", req.GetRunId(), req.GetNodeId())
	}
	return tenant, nil
}
