package store

import (
	"context"
	"time"
)

// Approvals holds approval gates: tool calls that wait for a human's decision before
// their effect (docs/operations.md, "Approval gates"). A request is keyed by tenant, run,
// node and idempotency key, so that a call re-sent after a takeover (the same node, the
// same key) finds the request it made before and keeps waiting on it; the first decision
// stands. Toolrunner writes requests and polls them; any orchestrator replica decides.
type Approvals interface {
	// RequestApproval creates a in ApprovalPending (Tenant, RunID, NodeID and Tool
	// required; RequestedAt is the store's clock), or, when the key already names a
	// request, returns that one unchanged with created=false, whatever its state.
	RequestApproval(ctx context.Context, a Approval) (out Approval, created bool, err error)
	// GetApproval returns the request of (tenant, run, node, key), or ErrNotFound.
	GetApproval(ctx context.Context, tenant, runID, nodeID, key string) (Approval, error)
	// DecideApproval decides the latest request of the node: a pending one takes d's
	// state (ApprovalApproved or ApprovalDenied), actor and reason, at the store's clock.
	// Deciding again the same way returns it unchanged; any other decision of a request
	// no longer pending is ErrConflict (and returns the request as it stands).
	// ErrNotFound when the node has no request.
	DecideApproval(ctx context.Context, d ApprovalDecision) (Approval, error)
	// EndApproval ends a pending request without a human's decision, with state
	// ApprovalTimedOut or ApprovalCancelled; a request already ended is returned
	// unchanged (a decision that came first stands), with ended=false.
	EndApproval(ctx context.Context, tenant, runID, nodeID, key string, state ApprovalState) (out Approval, ended bool, err error)
	// ListApprovals returns the requests q selects, oldest first.
	ListApprovals(ctx context.Context, q ApprovalQuery) ([]Approval, error)
}

// ApprovalState is where an approval request stands.
type ApprovalState string

// Approval states.
const (
	ApprovalPending   ApprovalState = "pending"
	ApprovalApproved  ApprovalState = "approved"
	ApprovalDenied    ApprovalState = "denied"
	ApprovalTimedOut  ApprovalState = "timed_out" // no decision before the wait's cap
	ApprovalCancelled ApprovalState = "cancelled" // the call was cancelled while it waited
)

// Approval is one tool call waiting for, or decided by, a human.
type Approval struct {
	Tenant         string
	RunID          string
	NodeID         string
	IdempotencyKey string
	Tool           string
	ArgumentsJSON  string
	// Why it needs approval: "registry", "destructive_hint" or "plan".
	Why         string
	State       ApprovalState
	RequestedAt time.Time
	// ExpiresAt is the wait's cap: the run's deadline less the tool's minimum time.
	ExpiresAt time.Time
	DecidedBy string // "key:<id>" or "mesh:<identity>"; empty until decided
	DecidedAt time.Time
	Reason    string
}

// ApprovalDecision is a human's decision of a node's request.
type ApprovalDecision struct {
	Tenant, RunID, NodeID string
	Approve               bool
	Actor                 string
	Reason                string
}

// ApprovalQuery selects approval requests.
type ApprovalQuery struct {
	PendingOnly bool
	Tenant      string // "": every tenant
	RunID       string // "": every run
	Limit       int    // 0: 1000
}
