package storetest

import (
	"errors"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

func (e *env) request(s store.Store, a store.Approval) (store.Approval, bool) {
	e.t.Helper()
	out, created, err := s.RequestApproval(e.ctx, a)
	if err != nil {
		e.t.Fatalf("request %+v: %v", a, err)
	}
	return out, created
}

var approvalTests = map[string]func(*env){
	"RequestIsCreateOrGet": func(e *env) {
		exp := e.clock.Now().Add(time.Minute)
		a := store.Approval{Tenant: "t1", RunID: "r1", NodeID: "root/s0.t0", IdempotencyKey: "k1", Tool: "notify",
			ArgumentsJSON: `{"channel":"ops"}`, Why: "plan", ExpiresAt: exp}
		got, created := e.request(e.s, a)
		if !created || got.State != store.ApprovalPending || !got.RequestedAt.Equal(e.clock.Now()) || !got.ExpiresAt.Equal(exp) ||
			got.Tool != "notify" || got.ArgumentsJSON != a.ArgumentsJSON || got.Why != "plan" || got.DecidedBy != "" {
			e.t.Fatalf("first request: %+v created=%v", got, created)
		}
		// The call re-sent after a takeover, through another replica, finds the same row.
		e.clock.Advance(time.Second)
		again, created := e.request(e.open(), store.Approval{Tenant: "t1", RunID: "r1", NodeID: "root/s0.t0", IdempotencyKey: "k1",
			Tool: "notify", ExpiresAt: exp.Add(time.Hour)})
		if created || !again.RequestedAt.Equal(got.RequestedAt) || !again.ExpiresAt.Equal(exp) || again.ArgumentsJSON != a.ArgumentsJSON {
			e.t.Fatalf("second request: %+v created=%v", again, created)
		}
		// Concurrent requests with one key make one row.
		b := a
		b.NodeID = "root/s1.t0"
		n := 0
		done := make(chan bool, 8)
		parallel(8, func(int) {
			_, c, err := e.s.RequestApproval(e.ctx, b)
			if err != nil {
				e.t.Errorf("concurrent request: %v", err)
			}
			done <- c
		})
		close(done)
		for c := range done {
			if c {
				n++
			}
		}
		if n != 1 {
			e.t.Fatalf("%d concurrent requests created a row, want 1", n)
		}
		if _, _, err := e.s.RequestApproval(e.ctx, store.Approval{Tenant: "t1", RunID: "r1"}); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("request without node and tool: %v", err)
		}
		if _, err := e.s.GetApproval(e.ctx, "t2", "r1", "root/s0.t0", "k1"); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("another tenant's: %v", err)
		}
	},
	"DecideFirstStands": func(e *env) {
		e.request(e.s, store.Approval{Tenant: "t1", RunID: "r1", NodeID: "n", IdempotencyKey: "k", Tool: "notify"})
		e.clock.Advance(time.Second)
		d := store.ApprovalDecision{Tenant: "t1", RunID: "r1", NodeID: "n", Approve: true, Actor: "key:ops", Reason: "looks fine"}
		got, err := e.open().DecideApproval(e.ctx, d)
		if err != nil || got.State != store.ApprovalApproved || got.DecidedBy != "key:ops" || got.Reason != "looks fine" ||
			!got.DecidedAt.Equal(e.clock.Now()) {
			e.t.Fatalf("approve: %+v, %v", got, err)
		}
		// The same decision again: unchanged, no error.
		e.clock.Advance(time.Second)
		d2 := d
		d2.Actor, d2.Reason = "key:other", "again"
		again, err := e.s.DecideApproval(e.ctx, d2)
		if err != nil || again.DecidedBy != "key:ops" || !again.DecidedAt.Equal(got.DecidedAt) || again.Reason != "looks fine" {
			e.t.Fatalf("approve again: %+v, %v", again, err)
		}
		// The other decision: a conflict, the first stands.
		d.Approve = false
		if cur, err := e.s.DecideApproval(e.ctx, d); !errors.Is(err, store.ErrConflict) || cur.State != store.ApprovalApproved {
			e.t.Fatalf("deny after approve: %+v, %v", cur, err)
		}
		// The waiter polls and sees it.
		if cur, err := e.s.GetApproval(e.ctx, "t1", "r1", "n", "k"); err != nil || cur.State != store.ApprovalApproved {
			e.t.Fatalf("get: %+v, %v", cur, err)
		}
		// A re-sent request of the decided call returns the decision.
		if cur, created := e.request(e.s, store.Approval{Tenant: "t1", RunID: "r1", NodeID: "n", IdempotencyKey: "k", Tool: "notify"}); created ||
			cur.State != store.ApprovalApproved {
			e.t.Fatalf("request after decision: %+v created=%v", cur, created)
		}
		if _, err := e.s.DecideApproval(e.ctx, store.ApprovalDecision{Tenant: "t1", RunID: "r1", NodeID: "nope", Actor: "key:ops"}); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("decide a node without a request: %v", err)
		}
		if _, err := e.s.DecideApproval(e.ctx, store.ApprovalDecision{Tenant: "t1", RunID: "r1", NodeID: "n"}); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("decide without actor: %v", err)
		}
	},
	"ConcurrentDecisions": func(e *env) {
		e.request(e.s, store.Approval{Tenant: "t1", RunID: "r1", NodeID: "n", IdempotencyKey: "k", Tool: "notify"})
		errs := make(chan error, 8)
		parallel(8, func(i int) {
			_, err := e.s.DecideApproval(e.ctx, store.ApprovalDecision{Tenant: "t1", RunID: "r1", NodeID: "n", Approve: i%2 == 0, Actor: "key:ops"})
			errs <- err
		})
		close(errs)
		cur, _ := e.s.GetApproval(e.ctx, "t1", "r1", "n", "k")
		ok, conflicts := 0, 0
		for err := range errs {
			switch {
			case err == nil:
				ok++
			case errors.Is(err, store.ErrConflict):
				conflicts++
			default:
				e.t.Fatalf("decide: %v", err)
			}
		}
		// Every decision like the one that stands succeeds, the others conflict.
		if ok != 4 || conflicts != 4 || (cur.State != store.ApprovalApproved && cur.State != store.ApprovalDenied) {
			e.t.Fatalf("ok %d conflicts %d state %s", ok, conflicts, cur.State)
		}
	},
	"EndTimedOutCancelled": func(e *env) {
		e.request(e.s, store.Approval{Tenant: "t1", RunID: "r1", NodeID: "a", IdempotencyKey: "k", Tool: "notify"})
		e.request(e.s, store.Approval{Tenant: "t1", RunID: "r1", NodeID: "b", IdempotencyKey: "k", Tool: "notify"})
		got, ended, err := e.s.EndApproval(e.ctx, "t1", "r1", "a", "k", store.ApprovalTimedOut)
		if err != nil || !ended || got.State != store.ApprovalTimedOut || got.DecidedAt.IsZero() {
			e.t.Fatalf("time out: %+v %v %v", got, ended, err)
		}
		// A decision after the cap: refused, the timeout stands.
		if cur, err := e.s.DecideApproval(e.ctx, store.ApprovalDecision{Tenant: "t1", RunID: "r1", NodeID: "a", Approve: true, Actor: "key:ops"}); !errors.Is(err, store.ErrConflict) ||
			cur.State != store.ApprovalTimedOut {
			e.t.Fatalf("approve after timeout: %+v, %v", cur, err)
		}
		// A decision that came first stands against a cancel.
		if _, err := e.s.DecideApproval(e.ctx, store.ApprovalDecision{Tenant: "t1", RunID: "r1", NodeID: "b", Actor: "key:ops"}); err != nil {
			e.t.Fatal(err)
		}
		got, ended, err = e.s.EndApproval(e.ctx, "t1", "r1", "b", "k", store.ApprovalCancelled)
		if err != nil || ended || got.State != store.ApprovalDenied {
			e.t.Fatalf("cancel after deny: %+v %v %v", got, ended, err)
		}
		if _, _, err := e.s.EndApproval(e.ctx, "t1", "r1", "b", "k", store.ApprovalApproved); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("end as approved: %v", err)
		}
	},
	"List": func(e *env) {
		e.request(e.s, store.Approval{Tenant: "t1", RunID: "r1", NodeID: "a", Tool: "notify"})
		e.clock.Advance(time.Millisecond)
		e.request(e.s, store.Approval{Tenant: "t2", RunID: "r2", NodeID: "a", Tool: "notify"})
		e.clock.Advance(time.Millisecond)
		e.request(e.s, store.Approval{Tenant: "t1", RunID: "r3", NodeID: "a", Tool: "deploy"})
		if _, err := e.s.DecideApproval(e.ctx, store.ApprovalDecision{Tenant: "t1", RunID: "r3", NodeID: "a", Approve: true, Actor: "key:ops"}); err != nil {
			e.t.Fatal(err)
		}
		all, err := e.open().ListApprovals(e.ctx, store.ApprovalQuery{})
		if err != nil || len(all) != 3 || all[0].RunID != "r1" || all[1].RunID != "r2" || all[2].RunID != "r3" {
			e.t.Fatalf("all: %+v, %v", all, err)
		}
		pending, err := e.s.ListApprovals(e.ctx, store.ApprovalQuery{PendingOnly: true, Tenant: "t1"})
		if err != nil || len(pending) != 1 || pending[0].RunID != "r1" {
			e.t.Fatalf("t1 pending: %+v, %v", pending, err)
		}
		byRun, err := e.s.ListApprovals(e.ctx, store.ApprovalQuery{RunID: "r2"})
		if err != nil || len(byRun) != 1 || byRun[0].Tenant != "t2" {
			e.t.Fatalf("run r2: %+v, %v", byRun, err)
		}
	},
}
