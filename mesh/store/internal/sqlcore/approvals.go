package sqlcore

import (
	"context"
	"errors"
	"fmt"

	"github.com/curfew-mesh/curfew/mesh/store"
)

const approvalCols = `tenant, run_id, node_id, idem_key, tool, args, why, state, requested_ms, expires_ms, decided_by, decided_ms, reason`

func scanApproval(r Row) (store.Approval, error) {
	var (
		a                         store.Approval
		state                     string
		requested, expires, decid int64
	)
	if err := r.Scan(&a.Tenant, &a.RunID, &a.NodeID, &a.IdempotencyKey, &a.Tool, &a.ArgumentsJSON, &a.Why, &state,
		&requested, &expires, &a.DecidedBy, &decid, &a.Reason); err != nil {
		return store.Approval{}, err
	}
	a.State, a.RequestedAt, a.ExpiresAt, a.DecidedAt = store.ApprovalState(state), tm(requested), tm(expires), tm(decid)
	return a, nil
}

// writeApproval runs a write that returns one approval row (ErrNoRows: none matched).
func (s *Store) writeApproval(ctx context.Context, query string, args ...any) (store.Approval, error) {
	var out store.Approval
	err := s.d.Tx(ctx, func(q Querier) error {
		var err error
		out, err = scanApproval(q.QueryRow(ctx, query, args...))
		return err
	})
	return out, err
}

// RequestApproval implements store.Approvals.
func (s *Store) RequestApproval(ctx context.Context, a store.Approval) (store.Approval, bool, error) {
	if a.Tenant == "" || a.RunID == "" || a.NodeID == "" || a.Tool == "" {
		return store.Approval{}, false, invalid("approval needs tenant, run, node and tool")
	}
	out, err := s.writeApproval(ctx, `INSERT INTO approvals (`+approvalCols+`)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, '', 0, '')
		ON CONFLICT (tenant, run_id, node_id, idem_key) DO NOTHING RETURNING `+approvalCols,
		a.Tenant, a.RunID, a.NodeID, a.IdempotencyKey, a.Tool, a.ArgumentsJSON, a.Why, string(store.ApprovalPending),
		s.nowMs(), ms(a.ExpiresAt))
	if err == nil {
		return out, true, nil
	}
	if !errors.Is(err, ErrNoRows) {
		return store.Approval{}, false, err
	}
	out, err = s.GetApproval(ctx, a.Tenant, a.RunID, a.NodeID, a.IdempotencyKey)
	return out, false, err
}

// GetApproval implements store.Approvals.
func (s *Store) GetApproval(ctx context.Context, tenant, runID, nodeID, key string) (store.Approval, error) {
	a, err := scanApproval(s.d.Read().QueryRow(ctx, `SELECT `+approvalCols+` FROM approvals
		WHERE tenant = $1 AND run_id = $2 AND node_id = $3 AND idem_key = $4`, tenant, runID, nodeID, key))
	if errors.Is(err, ErrNoRows) {
		return store.Approval{}, fmt.Errorf("%w: no approval request of run %s node %s", store.ErrNotFound, runID, nodeID)
	}
	return a, err
}

// latestApproval returns the node's latest request.
func (s *Store) latestApproval(ctx context.Context, tenant, runID, nodeID string) (store.Approval, error) {
	a, err := scanApproval(s.d.Read().QueryRow(ctx, `SELECT `+approvalCols+` FROM approvals
		WHERE tenant = $1 AND run_id = $2 AND node_id = $3 ORDER BY requested_ms DESC, idem_key LIMIT 1`, tenant, runID, nodeID))
	if errors.Is(err, ErrNoRows) {
		return store.Approval{}, fmt.Errorf("%w: no approval request of run %s node %s", store.ErrNotFound, runID, nodeID)
	}
	return a, err
}

// DecideApproval implements store.Approvals.
func (s *Store) DecideApproval(ctx context.Context, d store.ApprovalDecision) (store.Approval, error) {
	if d.Tenant == "" || d.RunID == "" || d.NodeID == "" || d.Actor == "" {
		return store.Approval{}, invalid("approval decision needs tenant, run, node and actor")
	}
	want := store.ApprovalDenied
	if d.Approve {
		want = store.ApprovalApproved
	}
	cur, err := s.latestApproval(ctx, d.Tenant, d.RunID, d.NodeID)
	if err != nil {
		return store.Approval{}, err
	}
	// Compare-and-set on the state: of two decisions racing, the first stands.
	out, err := s.writeApproval(ctx, `UPDATE approvals SET state = $5, decided_by = $6, decided_ms = $7, reason = $8
		WHERE tenant = $1 AND run_id = $2 AND node_id = $3 AND idem_key = $4 AND state = $9 RETURNING `+approvalCols,
		cur.Tenant, cur.RunID, cur.NodeID, cur.IdempotencyKey, string(want), d.Actor, s.nowMs(), d.Reason, string(store.ApprovalPending))
	if err == nil {
		return out, nil
	}
	if !errors.Is(err, ErrNoRows) {
		return store.Approval{}, err
	}
	cur, err = s.GetApproval(ctx, cur.Tenant, cur.RunID, cur.NodeID, cur.IdempotencyKey)
	if err != nil {
		return store.Approval{}, err
	}
	if cur.State == want {
		return cur, nil
	}
	return cur, fmt.Errorf("%w: the approval request of run %s node %s is already %s", store.ErrConflict, d.RunID, d.NodeID, cur.State)
}

// EndApproval implements store.Approvals.
func (s *Store) EndApproval(ctx context.Context, tenant, runID, nodeID, key string, state store.ApprovalState) (store.Approval, bool, error) {
	if state != store.ApprovalTimedOut && state != store.ApprovalCancelled {
		return store.Approval{}, false, invalid("an approval ends without a decision as timed_out or cancelled, not %q", state)
	}
	out, err := s.writeApproval(ctx, `UPDATE approvals SET state = $5, decided_ms = $6
		WHERE tenant = $1 AND run_id = $2 AND node_id = $3 AND idem_key = $4 AND state = $7 RETURNING `+approvalCols,
		tenant, runID, nodeID, key, string(state), s.nowMs(), string(store.ApprovalPending))
	if err == nil {
		return out, true, nil
	}
	if !errors.Is(err, ErrNoRows) {
		return store.Approval{}, false, err
	}
	out, err = s.GetApproval(ctx, tenant, runID, nodeID, key)
	return out, false, err
}

// ListApprovals implements store.Approvals.
func (s *Store) ListApprovals(ctx context.Context, q store.ApprovalQuery) ([]store.Approval, error) {
	limit := q.Limit
	if limit <= 0 || limit > 1000 {
		limit = 1000
	}
	state := ""
	if q.PendingOnly {
		state = string(store.ApprovalPending)
	}
	rows, err := s.d.Read().Query(ctx, `SELECT `+approvalCols+` FROM approvals
		WHERE ($1 = '' OR tenant = $1) AND ($2 = '' OR run_id = $2) AND ($3 = '' OR state = $3)
		ORDER BY requested_ms, tenant, run_id, node_id, idem_key LIMIT $4`, q.Tenant, q.RunID, state, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []store.Approval
	for rows.Next() {
		a, err := scanApproval(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, a)
	}
	return out, rows.Err()
}
