package admin

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

type tenants map[string]admission.TenantLimits

func (t tenants) TenantLimits(tenant string) admission.TenantLimits { return t[tenant] }

// as is ctx as the caller holding a key of tenant ops, and that caller's name.
func as(t *testing.T) (context.Context, string) {
	t.Helper()
	k, err := apikey.New("ops")
	if err != nil {
		t.Fatal(err)
	}
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(apikey.Header, "Bearer "+k.Secret))
	return ctx, "key:" + k.Record.ID
}

func wantCode(t *testing.T, err error, c codes.Code) {
	t.Helper()
	if status.Code(err) != c {
		t.Fatalf("error %v, want %v", err, c)
	}
}

func TestDecideApproval(t *testing.T) {
	st := storetest.OpenMemory(t)
	alice, aliceName := as(t)
	bob, bobName := as(t)
	s := New(Config{Store: st, Tenants: tenants{"strict": {ApproverNotStarter: true}}})
	bg := context.Background()
	run := func(tenant string) string {
		r, _, err := st.CreateRun(bg, store.NewRun{Tenant: tenant, Task: []byte("x"), Deadline: time.Now().Add(time.Hour), StartedBy: aliceName})
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := st.RequestApproval(bg, store.Approval{Tenant: tenant, RunID: r.RunID, NodeID: "root/s0.t0", IdempotencyKey: "k", Tool: "notify", Why: "plan"}); err != nil {
			t.Fatal(err)
		}
		return r.RunID
	}
	lax, strict := run("lax"), run("strict")

	// Listed pending, with who started the run.
	ls, err := s.ListApprovals(bob, &adminv1.ListApprovalsRequest{PendingOnly: true})
	if err != nil || len(ls.GetApprovals()) != 2 || ls.GetApprovals()[0].GetRunStartedBy() != aliceName ||
		ls.GetApprovals()[0].GetState() != adminv1.ApprovalState_APPROVAL_STATE_PENDING {
		t.Fatalf("list: %v, %v", ls, err)
	}
	// The starter may approve a lax tenant's run (the tenant is found from the run).
	got, err := s.DecideApproval(alice, &adminv1.DecideApprovalRequest{RunId: lax, NodeId: "root/s0.t0", Approve: true, Reason: "fine"})
	if err != nil || got.GetApproval().GetState() != adminv1.ApprovalState_APPROVAL_STATE_APPROVED || got.GetApproval().GetDecidedBy() != aliceName {
		t.Fatalf("approve: %v, %v", got, err)
	}
	// Again the same way: unchanged; the other way: FAILED_PRECONDITION.
	if again, err := s.DecideApproval(bob, &adminv1.DecideApprovalRequest{RunId: lax, NodeId: "root/s0.t0", Approve: true}); err != nil ||
		again.GetApproval().GetDecidedBy() != aliceName {
		t.Fatalf("approve again: %v, %v", again, err)
	}
	_, err = s.DecideApproval(bob, &adminv1.DecideApprovalRequest{RunId: lax, NodeId: "root/s0.t0"})
	wantCode(t, err, codes.FailedPrecondition)
	// A strict tenant refuses the starter, and takes another approver.
	_, err = s.DecideApproval(alice, &adminv1.DecideApprovalRequest{Tenant: "strict", RunId: strict, NodeId: "root/s0.t0", Approve: true})
	wantCode(t, err, codes.PermissionDenied)
	if got, err := s.DecideApproval(bob, &adminv1.DecideApprovalRequest{RunId: strict, NodeId: "root/s0.t0", Reason: "no"}); err != nil ||
		got.GetApproval().GetState() != adminv1.ApprovalState_APPROVAL_STATE_DENIED || got.GetApproval().GetDecidedBy() != bobName {
		t.Fatalf("deny: %v, %v", got, err)
	}
	_, err = s.DecideApproval(bob, &adminv1.DecideApprovalRequest{RunId: "nope", NodeId: "root/s0.t0"})
	wantCode(t, err, codes.NotFound)
	_, err = s.DecideApproval(bob, &adminv1.DecideApprovalRequest{RunId: lax})
	wantCode(t, err, codes.InvalidArgument)
	// Each decision is audited with its reason.
	au, _, err := st.ListAudit(bg, store.AuditQuery{})
	if err != nil || len(au) != 3 || au[2].Action != "ApproveApproval" || au[2].Reason != "fine" || au[0].Action != "DenyApproval" || au[0].Actor != bobName {
		t.Fatalf("audit %+v, %v", au, err)
	}
	if pend, _ := s.ListApprovals(bob, &adminv1.ListApprovalsRequest{PendingOnly: true}); len(pend.GetApprovals()) != 0 {
		t.Fatalf("pending after the decisions: %v", pend)
	}
}
