package e2e

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// A plan with two steps, three parallel tools, and a subagent that spawns its own
// subagent finishes within its deadline, and every node succeeds.
func TestPlanCompletes(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 200, "steps": [
	  {"think_tokens": 20, "tools": [
	    {"name": "sleep", "args": {"ms": 300}},
	    {"name": "deploy", "args": {"duration_ms": 400, "poll_ms": 50}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 200, "steps": [
	      {"think_tokens": 10, "tools": [{"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 200, "steps": [{"answer_tokens": 30}]}}}]},
	      {"answer_tokens": 20}]}}}]},
	  {"answer_tokens": 40}]}`
	ctx := context.Background()
	c := client(t)
	start := time.Now()
	res, _ := runPlan(ctx, c, plan, 20*time.Second, 0, false)
	if res.err != nil {
		t.Fatalf("Run: %v", res.err)
	}
	r := res.finished
	if r == nil {
		t.Fatal("no summary event")
	}
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || r.GetAnswer() == "" {
		t.Fatalf("run did not succeed with an answer:\n%s", dump(r))
	}
	if r.GetEndedAt().AsTime().After(r.GetDeadline().AsTime()) {
		t.Errorf("run ended after its deadline")
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("run took %v", d)
	}
	want := []string{"root", "root/m0", "root/m1", "root/s0.t0", "root/s0.t1", "root/s0.t2", "root/s0.t2/sub",
		"root/s0.t2/sub/m0", "root/s0.t2/sub/m1", "root/s0.t2/sub/s0.t0", "root/s0.t2/sub/s0.t0/sub", "root/s0.t2/sub/s0.t0/sub/m0"}
	ns := nodeMap(r)
	for _, id := range want {
		n, ok := ns[id]
		if !ok {
			t.Errorf("node %s missing", id)
			continue
		}
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			t.Errorf("node %s: %s", id, n.GetStatus())
		}
	}
	if len(ns) != len(want) {
		t.Errorf("got %d nodes, want %d:\n%s", len(ns), len(want), dump(r))
	}
	// The token figures come from the decoders' ledger: 20+40 at the root, 10+20 and 30 below.
	if got := ns["root/m0"].GetTokens() + ns["root/m1"].GetTokens(); got != 60 {
		t.Errorf("root decoders spent %d tokens, want 60", got)
	}
	if r.GetTokens() != 60+30+30 {
		t.Errorf("run tokens %d, want 120", r.GetTokens())
	}
	// Events streamed live include nodes from all four processes.
	seen := map[meshv1.NodeKind]bool{}
	for _, n := range res.nodes {
		seen[n.GetKind()] = true
	}
	for _, k := range []meshv1.NodeKind{meshv1.NodeKind_NODE_KIND_MODEL, meshv1.NodeKind_NODE_KIND_TOOL, meshv1.NodeKind_NODE_KIND_SUBAGENT, meshv1.NodeKind_NODE_KIND_RUN} {
		if !seen[k] {
			t.Errorf("no %s node event in the stream", k)
		}
	}
}

// Seed 003's drill knobs: eight runs decoding at 40 tokens/s with a 12 s deadline,
// subagents two deep and parallel tools; every client disconnects at 3.5 s.
func TestSeed003DisconnectDrill(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 20, "tools": [
	    {"name": "sleep", "args": {"ms": 20000}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [
	      {"think_tokens": 10, "tools": [
	        {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [{"answer_tokens": 800}]}}},
	        {"name": "sleep", "args": {"ms": 20000}}]},
	      {"answer_tokens": 40}]}}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [{"answer_tokens": 800}]}}}]},
	  {"answer_tokens": 40}]}`
	const runs = 8
	ctx := context.Background()
	c := client(t)
	type out struct {
		res      result
		cancelAt time.Time
	}
	outs := make([]out, runs)
	var wg sync.WaitGroup
	for i := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			outs[i].res, outs[i].cancelAt = runPlan(ctx, c, plan, 12*time.Second, 3500*time.Millisecond, false)
		}()
	}
	wg.Wait()
	mp, err := mesh.Report("modelproxy")
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range outs {
		if o.res.started == nil {
			t.Fatalf("run %d: never started: %v", i, o.res.err)
		}
		if code(o.res.err) != codes.Canceled.String() {
			t.Errorf("run %d: call ended with %v, want CANCELED from the client's own cancel", i, o.res.err)
		}
		r := summary(ctx, t, c, o.res.started.GetRunId())
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
			t.Errorf("run %d: %s cause %s, want cancelled by client_disconnect", i, r.GetStatus(), r.GetCause())
		}
		cancelAt := r.GetCancelledAt().AsTime()
		if cancelAt.Before(o.cancelAt) || cancelAt.Sub(o.cancelAt) > time.Second {
			t.Errorf("run %d: orchestrator recorded the cancel at %s, client cancelled at %s", i, fmtTime(cancelAt), fmtTime(o.cancelAt))
		}
		ns := nodeMap(r)
		// The tree at 3.5 s: these were all running, two levels of subagents deep.
		for _, id := range []string{"root", "root/s0.t0", "root/s0.t1", "root/s0.t1/sub", "root/s0.t1/sub/s0.t0", "root/s0.t1/sub/s0.t0/sub",
			"root/s0.t1/sub/s0.t0/sub/m0", "root/s0.t1/sub/s0.t1", "root/s0.t2", "root/s0.t2/sub", "root/s0.t2/sub/m0"} {
			n := ns[id]
			if n == nil {
				t.Errorf("run %d: node %s missing\n%s", i, id, dump(r))
				continue
			}
			if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
				t.Errorf("run %d: node %s %s cause %s, want cancelled by client_disconnect", i, id, n.GetStatus(), n.GetCause())
			}
		}
		decoders := 0
		for id, n := range ns {
			// Every node ends with cause client_disconnect, except those that had
			// already finished before the cancel.
			if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
				if !n.GetEndedAt().AsTime().Before(cancelAt) {
					t.Errorf("run %d: node %s succeeded after the cancel", i, id)
				}
			} else if n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
				t.Errorf("run %d: node %s: %s cause %s", i, id, n.GetStatus(), n.GetCause())
			}
			// No node starts after the cancel.
			if n.GetStartedAt().AsTime().After(cancelAt) {
				t.Errorf("run %d: node %s started %v after the cancel", i, id, n.GetStartedAt().AsTime().Sub(cancelAt))
			}
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL {
				decoders++
				if n.GetTokensAfterCancel() > 1 {
					t.Errorf("run %d: decoder %s spent %d tokens after the cancel (at most 1 allowed)", i, id, n.GetTokensAfterCancel())
				}
				if n.GetTokensAtCancel()+n.GetTokensAfterCancel() != n.GetTokens() {
					t.Errorf("run %d: decoder %s token split %d+%d != %d", i, id, n.GetTokensAtCancel(), n.GetTokensAfterCancel(), n.GetTokens())
				}
			}
		}
		if decoders != 4 {
			t.Errorf("run %d: %d decoders, want 4\n%s", i, decoders, dump(r))
		}
		if r.GetTokensAfterCancel() > int64(decoders) {
			t.Errorf("run %d: %d tokens after cancel over %d decoders", i, r.GetTokensAfterCancel(), decoders)
		}
		// The decoders at 40 tokens/s ran about 3 s before the cancel: the ledger saw them.
		if leaf := ns["root/s0.t2/sub/m0"]; leaf.GetTokensAtCancel() < 60 {
			t.Errorf("run %d: leaf decoder spent only %d tokens before the cancel", i, leaf.GetTokensAtCancel())
		}
		if t.Failed() {
			t.Logf("%s", dump(r))
			continue
		}
		// Tokens stay frozen: a second later the decoders' own ledger has not moved and no
		// decoder of the run is in flight.
		time.Sleep(time.Second)
		resp, err := mp.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: r.GetRunId(), CancelAt: r.GetCancelledAt()})
		if err != nil {
			t.Fatal(err)
		}
		var total int64
		for _, n := range resp.GetNodes() {
			total += n.GetTokens()
			if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
				t.Errorf("run %d: decoder %s still running a second after the cancel", i, n.GetId())
			}
		}
		if total != r.GetTokens() {
			t.Errorf("run %d: ledger shows %d tokens a second later, the summary %d: spend did not freeze", i, total, r.GetTokens())
		}
	}
}

// A plan that would take 10 s, run with a 2 s deadline, ends DEADLINE_EXCEEDED; every node
// has stopped within the deadline plus a stated bound, and nothing starts after it.
func TestDeadlineStopsTheTree(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 20, "tools": [
	    {"name": "sleep", "args": {"ms": 9000}},
	    {"name": "spawn_subagent", "args": {"plan": {"steps": [
	      {"think_tokens": 10, "tools": [{"name": "sleep", "args": {"ms": 9000}}]},
	      {"answer_tokens": 40}]}}},
	    {"name": "spawn_subagent", "args": {"plan": {"steps": [{"answer_tokens": 400}]}}}]},
	  {"think_tokens": 40, "tools": [{"name": "sleep", "args": {"ms": 100}}]},
	  {"answer_tokens": 40}]}`
	// The bound on how long after the deadline a node may still be recorded as running:
	// cancel propagation is milliseconds; the rest is margin for a loaded 2-core machine.
	const bound = 750 * time.Millisecond
	ctx := context.Background()
	c := client(t)
	res, _ := runPlan(ctx, c, plan, 2*time.Second, 0, false)
	if code(res.err) != codes.DeadlineExceeded.String() {
		t.Fatalf("Run ended with %v, want DEADLINE_EXCEEDED", res.err)
	}
	r := summary(ctx, t, c, res.started.GetRunId())
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE ||
		r.GetErrorCode() != "DEADLINE_EXCEEDED" {
		t.Fatalf("run: %s cause %s code %s\n%s", r.GetStatus(), r.GetCause(), r.GetErrorCode(), dump(r))
	}
	dl := r.GetDeadline().AsTime()
	if d := dl.Sub(res.started.GetDeadline().AsTime()); d != 0 {
		t.Errorf("the deadline changed during the run by %v", d)
	}
	for _, n := range r.GetNodes() {
		if n.GetEndedAt() == nil || n.GetEndedAt().AsTime().After(dl.Add(bound)) {
			t.Errorf("node %s stopped %v after the deadline (bound %v)", n.GetId(), n.GetEndedAt().AsTime().Sub(dl), bound)
		}
		if n.GetStartedAt().AsTime().After(dl) {
			t.Errorf("node %s started after the deadline", n.GetId())
		}
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED && n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
			t.Errorf("node %s: %s cause %s, want deadline", n.GetId(), n.GetStatus(), n.GetCause())
		}
		if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL && n.GetTokensAfterCancel() > 1 {
			t.Errorf("decoder %s spent %d tokens after the deadline", n.GetId(), n.GetTokensAfterCancel())
		}
	}
	// The second model step (root/m1) would have started at about 9 s: it never started.
	if _, ok := nodeMap(r)["root/m1"]; ok {
		t.Errorf("root/m1 started although the deadline had passed")
	}
	if t.Failed() {
		t.Logf("%s", dump(r))
	}
}

// A fail tool beside two long sleeps fails the step: the sleeps end with cause
// sibling_failed before the error reaches the caller.
func TestSiblingFailure(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 200, "steps": [
	  {"think_tokens": 10, "tools": [
	    {"name": "sleep", "args": {"ms": 10000}},
	    {"name": "fail", "args": {"after_ms": 300, "times": 10, "code": "UNAVAILABLE"}},
	    {"name": "spawn_subagent", "args": {"plan": {"steps": [{"answer_tokens": 400}]}}}]},
	  {"answer_tokens": 10}]}`
	ctx := context.Background()
	c := client(t)
	res, _ := runPlan(ctx, c, plan, 20*time.Second, 0, false)
	if code(res.err) != codes.Unavailable.String() || !strings.Contains(status.Convert(res.err).Message(), "injected failure") {
		t.Fatalf("Run ended with %v, want the fail tool's UNAVAILABLE", res.err)
	}
	r := res.finished
	if r == nil {
		t.Fatal("no summary before the error")
	}
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED || r.GetErrorCode() != "UNAVAILABLE" {
		t.Fatalf("run %s %s\n%s", r.GetStatus(), r.GetErrorCode(), dump(r))
	}
	ns := nodeMap(r)
	if f := ns["root/s0.t1"]; f.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || f.GetErrorCode() != "UNAVAILABLE" {
		t.Errorf("fail tool: %s %s", f.GetStatus(), f.GetErrorCode())
	}
	// UNAVAILABLE is retried, at most 3 attempts in all, then the step fails.
	if f := ns["root/s0.t1"]; f.GetAttempt() != 3 || len(f.GetEarlierAttempts()) != 2 {
		t.Errorf("fail tool: attempt %d with %d earlier attempts, want the 3rd of 3", f.GetAttempt(), len(f.GetEarlierAttempts()))
	}
	failedAt := ns["root/s0.t1"].GetEndedAt().AsTime()
	for _, id := range []string{"root/s0.t0", "root/s0.t2", "root/s0.t2/sub", "root/s0.t2/sub/m0"} {
		n := ns[id]
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED {
			t.Errorf("%s: %s cause %s, want cancelled by sibling_failed", id, n.GetStatus(), n.GetCause())
		}
		ended := n.GetEndedAt().AsTime()
		if !ended.Before(res.errAt) {
			t.Errorf("%s ended at %s, after the error reached the caller at %s", id, fmtTime(ended), fmtTime(res.errAt))
		}
		if ended.Sub(failedAt) > 2*time.Second {
			t.Errorf("%s took %v to stop after its sibling failed", id, ended.Sub(failedAt))
		}
	}
	if m := ns["root/s0.t2/sub/m0"]; m.GetTokens() == 0 || m.GetTokens() > 200 {
		t.Errorf("the subagent's decoder spent %d tokens; it should have been stopped early", m.GetTokens())
	}
	if t.Failed() {
		t.Logf("%s", dump(r))
	}
}

// deploy cancelled mid-poll runs its abort on its own budget: the abort completes even
// though the run's deadline has already expired; one that overruns its budget is reported.
func TestCleanupBudget(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 200, "steps": [
	  {"think_tokens": 10, "tools": [
	    {"name": "deploy", "args": {"duration_ms": 20000, "poll_ms": 100, "abort_ms": 800, "cleanup_ms": 3000}},
	    {"name": "deploy", "args": {"duration_ms": 20000, "poll_ms": 100, "abort_ms": 3000, "cleanup_ms": 300}}]},
	  {"answer_tokens": 10}]}`
	ctx := context.Background()
	c := client(t)
	res, _ := runPlan(ctx, c, plan, 1500*time.Millisecond, 0, false)
	if code(res.err) != codes.DeadlineExceeded.String() {
		t.Fatalf("Run ended with %v, want DEADLINE_EXCEEDED", res.err)
	}
	r := summary(ctx, t, c, res.started.GetRunId())
	dl := r.GetDeadline().AsTime()
	ns := nodeMap(r)
	ok := ns["root/s0.t0"]
	cl := ok.GetCleanup()
	if cl == nil || !cl.GetCompleted() {
		t.Fatalf("deploy abort did not complete: %v\n%s", cl, dump(r))
	}
	if !cl.GetEndedAt().AsTime().After(dl) {
		t.Errorf("the abort ended at %s, not after the deadline %s: it did not run on its own budget", fmtTime(cl.GetEndedAt().AsTime()), fmtTime(dl))
	}
	if d := cl.GetEndedAt().AsTime().Sub(cl.GetStartedAt().AsTime()); d < 700*time.Millisecond || d > 2500*time.Millisecond {
		t.Errorf("the abort took %v, want about 800ms", d)
	}
	if ok.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE || ok.GetEndedAt().AsTime().Before(cl.GetEndedAt().AsTime()) {
		t.Errorf("deploy node: cause %s, ended %s before its abort finished %s", ok.GetCause(), fmtTime(ok.GetEndedAt().AsTime()), fmtTime(cl.GetEndedAt().AsTime()))
	}
	over := ns["root/s0.t1"].GetCleanup()
	if over == nil || over.GetCompleted() || over.GetError() == "" {
		t.Errorf("an abort longer than its 300ms budget must be reported as not completed: %v", over)
	} else if d := over.GetEndedAt().AsTime().Sub(over.GetStartedAt().AsTime()); d > 2*time.Second {
		t.Errorf("the overrunning abort was not cut at its budget: ran %v", d)
	}
	// The run's end waited for its tree's teardown, aborts included.
	if r.GetEndedAt().AsTime().Before(cl.GetEndedAt().AsTime()) {
		t.Errorf("the run ended before its deploy abort finished")
	}
}

// A client asking for a 10-hour deadline is capped to the maximum; a child never sees a
// later deadline than its parent.
func TestDeadlinesNeverGrow(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 200, "steps": [
	  {"think_tokens": 10, "tools": [
	    {"name": "sleep", "args": {"ms": 50}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 200, "steps": [
	      {"think_tokens": 10, "tools": [{"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 200, "steps": [{"answer_tokens": 10}]}}}]},
	      {"answer_tokens": 10}]}}}]},
	  {"answer_tokens": 10}]}`
	ctx := context.Background()
	c := client(t)
	for _, tc := range []struct {
		name   string
		ask    time.Duration
		expect time.Duration
	}{{"capped", 10 * time.Hour, 10 * time.Minute}, {"kept", 7 * time.Second, 7 * time.Second}} {
		before := time.Now()
		res, _ := runPlan(ctx, c, plan, tc.ask, 0, false)
		if res.err != nil {
			t.Fatalf("%s: %v", tc.name, res.err)
		}
		r := res.finished
		// The run's absolute deadline is fixed on arrival from the relative grpc-timeout (or
		// the cap), so it lies between the call's start and the first event, plus expect.
		dl := r.GetDeadline().AsTime()
		if dl.Before(before.Add(tc.expect)) || dl.After(res.startAt.Add(tc.expect)) {
			t.Errorf("%s: asked %v, got a deadline %v after the call's start (first event after %v); want %v",
				tc.name, tc.ask, dl.Sub(before), res.startAt.Sub(before), tc.expect)
		}
		ns := nodeMap(r)
		for id, n := range ns {
			if n.GetDeadline() == nil {
				t.Errorf("%s: node %s has no deadline", tc.name, id)
				continue
			}
			if n.GetDeadline().AsTime().After(dl) {
				t.Errorf("%s: node %s deadline %s after the run's %s", tc.name, id, fmtTime(n.GetDeadline().AsTime()), fmtTime(dl))
			}
			// Walk up to the nearest recorded ancestor.
			for p := parent(id); p != ""; p = parent(p) {
				if pn, ok := ns[p]; ok {
					if n.GetDeadline().AsTime().After(pn.GetDeadline().AsTime()) {
						t.Errorf("%s: node %s sees a later deadline (%s) than its parent %s (%s)", tc.name, id,
							fmtTime(n.GetDeadline().AsTime()), p, fmtTime(pn.GetDeadline().AsTime()))
					}
					break
				}
			}
		}
		if len(ns) < 10 {
			t.Errorf("%s: only %d nodes", tc.name, len(ns))
		}
	}
}

func parent(id string) string {
	i := strings.LastIndexByte(id, '/')
	if i < 0 {
		return ""
	}
	return id[:i]
}

// CancelRun stops the tree with cause operator and returns once it has been torn down.
func TestOperatorCancel(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 10, "tools": [
	    {"name": "sleep", "args": {"ms": 20000}},
	    {"name": "spawn_subagent", "args": {"plan": {"steps": [{"answer_tokens": 800}]}}}]},
	  {"answer_tokens": 10}]}`
	ctx := context.Background()
	c := client(t)
	done := make(chan result, 1)
	started := make(chan string, 1)
	go func() {
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		st, err := c.Run(cctx, &orchestratorv1.RunRequest{Task: plan})
		var res result
		if err != nil {
			res.err = err
			close(started)
			done <- res
			return
		}
		for {
			ev, err := st.Recv()
			if err != nil {
				res.err = err
				break
			}
			if s := ev.GetStarted(); s != nil {
				started <- s.GetRunId()
			}
			if f := ev.GetFinished(); f != nil {
				res.finished = f
			}
		}
		done <- res
	}()
	id := <-started
	time.Sleep(1500 * time.Millisecond)
	cancelled := time.Now()
	resp, err := c.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "e2e"})
	if err != nil {
		t.Fatal(err)
	}
	r := resp.GetRun()
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Fatalf("CancelRun returned %s cause %s", r.GetStatus(), r.GetCause())
	}
	if r.GetCancelledAt().AsTime().Before(cancelled) {
		t.Errorf("cancel recorded before CancelRun was called")
	}
	for _, n := range r.GetNodes() {
		if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
			t.Errorf("node %s still running after CancelRun returned", n.GetId())
		}
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED && n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
			t.Errorf("node %s: %s cause %s", n.GetId(), n.GetStatus(), n.GetCause())
		}
		if n.GetTokensAfterCancel() > 1 {
			t.Errorf("node %s: %d tokens after the cancel", n.GetId(), n.GetTokensAfterCancel())
		}
	}
	res := <-done
	if code(res.err) != codes.Canceled.String() || res.finished.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Errorf("the Run stream ended with %v and summary cause %s", res.err, res.finished.GetCause())
	}
	// Cancelling again returns the ended run unchanged.
	again, err := c.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: id})
	if err != nil || again.GetRun().GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Errorf("second CancelRun: %v %v", err, again.GetRun().GetCause())
	}
	if _, err := c.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: "nope"}); status.Code(err) != codes.NotFound {
		t.Errorf("CancelRun of an unknown run: %v", err)
	}
}

// A run started with continue_on_disconnect goes on after its client leaves.
func TestContinueOnDisconnect(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 100, "steps": [
	  {"think_tokens": 10, "tools": [{"name": "sleep", "args": {"ms": 1500}}]},
	  {"answer_tokens": 10}]}`
	ctx := context.Background()
	c := client(t)
	res, _ := runPlan(ctx, c, plan, 20*time.Second, 500*time.Millisecond, true)
	if code(res.err) != codes.Canceled.String() || res.started == nil {
		t.Fatalf("Run: %v", res.err)
	}
	r := summary(ctx, t, c, res.started.GetRunId())
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("detached run: %s\n%s", r.GetStatus(), dump(r))
	}
}

// Bad input is refused before any work starts, with the field named.
func TestInvalidRequests(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := client(t)
	for _, tc := range []struct{ task, want string }{
		{"", "task is required"},
		{"summarize this", "JSON plan"},
		{`{"steps": [{"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": 0}}]}, {"answer_tokens": 1}]}`, "steps[0].tools[0].args.ms"},
		{`{"steps": [{"answer_tokens": 1, "oops": 2}]}`, `unknown field "oops"`},
		{`{"steps": [{"think_tokens": 1, "tools": [{"name": "rm_rf"}]}, {"answer_tokens": 1}]}`, `unknown tool "rm_rf"`},
	} {
		res, _ := runPlan(ctx, c, tc.task, 5*time.Second, 0, false)
		if status.Code(res.err) != codes.InvalidArgument || !strings.Contains(status.Convert(res.err).Message(), tc.want) {
			t.Errorf("task %q: %v, want INVALID_ARGUMENT mentioning %q", tc.task, res.err, tc.want)
		}
		if res.started != nil {
			t.Errorf("task %q started a run", tc.task)
		}
	}
	if _, err := c.GetRun(ctx, &orchestratorv1.GetRunRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("GetRun without id: %v", err)
	}
	if _, err := c.ListRuns(ctx, &orchestratorv1.ListRunsRequest{PageToken: "x"}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("ListRuns with a bad token: %v", err)
	}
}
