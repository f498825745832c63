package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// A WatchRun that reaches an orchestrator which does not own the run is relayed from the
// owner, so the run is watched live whichever replica the client reached, and the watch
// follows the run when its owner dies and another replica takes it over.

// watchFwdPlan: model steps that stream text, reporting sleeps of ms each, one of them in
// a subagent.
func watchFwdPlan(ms int) string {
	sleep := fmt.Sprintf(`{"name": "sleep", "args": {"ms": %d, "progress_ms": 100}}`, ms)
	return `{"tokens_per_second": 100, "steps": [
	  {"think_tokens": 5, "tools": [` + sleep + `]},
	  {"think_tokens": 5, "tools": [{"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 100, "steps": [
	      {"think_tokens": 3, "tools": [` + sleep + `]},
	      {"answer_tokens": 3}]}}}]},
	  {"think_tokens": 5, "tools": [` + sleep + `]},
	  {"answer_tokens": 5}]}`
}

// arrival is one WatchRun message and when it arrived.
type arrival struct {
	msg *orchestratorv1.WatchRunResponse
	at  time.Time
}

// watchAll reads a WatchRun to its end; after each message, seen (if set) is called
// with what arrived so far.
func watchAll(ctx context.Context, t *testing.T, c orchestratorv1.OrchestratorServiceClient, id string, seen func([]arrival)) ([]arrival, error) {
	t.Helper()
	st, err := c.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		return nil, err
	}
	var out []arrival
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, arrival{m, time.Now()})
		if seen != nil {
			seen(out)
		}
	}
}

// checkWatch checks a watch as its client reads it: one started event first, the summary
// last, and each node's events between its start and its end. It returns the summary and
// how many node updates and node events came before it.
func checkWatch(t *testing.T, got []arrival) (fin *orchestratorv1.Run, nodes, events int) {
	t.Helper()
	if len(got) < 2 || got[0].msg.GetStarted() == nil || got[len(got)-1].msg.GetFinished() == nil {
		t.Fatalf("WatchRun sent %d messages; want started first and the summary last", len(got))
	}
	running := map[string]bool{}
	for i, a := range got {
		switch {
		case a.msg.GetStarted() != nil && i > 0:
			t.Errorf("message %d is a second started event", i)
		case a.msg.GetFinished() != nil && i < len(got)-1:
			t.Errorf("message %d is a summary before the end", i)
		case a.msg.GetNode() != nil:
			nodes++
			n := a.msg.GetNode()
			running[n.GetId()] = n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING
		case a.msg.GetNodeEvent() != nil:
			events++
			// Text of a model node running when the watch joined comes before any update
			// of that node; a progress event comes while its tool runs.
			if ev := a.msg.GetNodeEvent(); ev.GetProgress() != nil {
				if r, ok := running[ev.GetNodeId()]; ok && !r {
					t.Errorf("message %d: progress of %s after its end", i, ev.GetNodeId())
				}
			}
		}
	}
	return got[len(got)-1].msg.GetFinished(), nodes, events
}

func TestWatchRunOnAnotherReplicaIsLive(t *testing.T) {
	r := newCrashRig(t, storetest.PostgresDSN(t))
	a, b := r.orchestrator("orchestrator-a"), r.orchestrator("orchestrator-b")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	resp, err := r.client(a).StartRun(ctx, &orchestratorv1.StartRunRequest{Task: watchFwdPlan(600), Timeout: durationpb.New(50 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetRun().GetRunId()

	// Another tenant's key sees nothing of the run through the other replica.
	other := tenantClient(ctx, t, r, b, "watchfwd-other")
	if _, err := other.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id}); status.Code(err) != codes.NotFound {
		t.Errorf("another tenant's GetRun via orchestrator-b: %v, want NOT_FOUND", err)
	}
	if got, err := watchAll(ctx, t, other, id, nil); status.Code(err) != codes.NotFound || len(got) != 0 {
		t.Errorf("another tenant's WatchRun via orchestrator-b: %d messages, %v; want NOT_FOUND and nothing", len(got), err)
	}

	got, err := watchAll(ctx, t, r.client(b), id, nil)
	if err != nil {
		t.Fatalf("WatchRun via orchestrator-b: %v", err)
	}
	fin, nodes, events := checkWatch(t, got)
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run ended %v: %s", fin.GetStatus(), fin.GetErrorMessage())
	}
	if nodes == 0 || events == 0 {
		t.Fatalf("%d node updates and %d node events before the summary, want the run live", nodes, events)
	}
	// Live: the first node event came while the run was still running (the plan has
	// three sleeps of 600 ms after it), not with the summary.
	first := got[len(got)-1].at
	for _, m := range got {
		if m.msg.GetNodeEvent() != nil {
			first = m.at
			break
		}
	}
	if lead := got[len(got)-1].at.Sub(first); lead < 500*time.Millisecond {
		t.Errorf("the first node event came %v before the summary, want ≥ 500ms (live, not at the end)", lead)
	}
	stored, err := r.client(b).GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(stored.GetRun(), fin) {
		t.Errorf("the watch's summary differs from GetRun's:\n%v\n%v", fin, stored.GetRun())
	}
	if fin.GetEpoch() != 1 {
		t.Errorf("run at epoch %d, want 1: orchestrator-a ran it", fin.GetEpoch())
	}
	t.Logf("via orchestrator-b: %d node updates, %d node events, the first event %v before the summary",
		nodes, events, got[len(got)-1].at.Sub(first).Round(time.Millisecond))
}

func TestWatchRunFollowsARunAcrossATakeover(t *testing.T) {
	r := newCrashRig(t, storetest.PostgresDSN(t))
	a, b, _ := r.orchestrator("orchestrator-a"), r.orchestrator("orchestrator-b"), r.orchestrator("orchestrator-c")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	resp, err := r.client(a).StartRun(ctx, &orchestratorv1.StartRunRequest{Task: watchFwdPlan(1500),
		IdempotencyKey: fmt.Sprintf("watchfwd-%d", time.Now().UnixNano()), Timeout: durationpb.New(60 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := resp.GetRun().GetRunId()
	r.runIDs = []string{id}

	var killedAt time.Time
	got, err := watchAll(ctx, t, r.client(b), id, func(got []arrival) {
		// Once the watch is live (a progress event of the first sleep), SIGKILL the owner.
		if !killedAt.IsZero() || got[len(got)-1].msg.GetNodeEvent().GetProgress() == nil {
			return
		}
		if err := a.Kill(); err != nil {
			t.Error(err)
		}
		killedAt = time.Now()
	})
	if err != nil {
		t.Fatalf("WatchRun via orchestrator-b across the takeover: %v", err)
	}
	if killedAt.IsZero() {
		t.Fatal("no progress event arrived via orchestrator-b before the run ended")
	}
	fin, _, _ := checkWatch(t, got)
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetEpoch() < 2 {
		t.Fatalf("run ended %v at epoch %d (%s), want SUCCEEDED after a takeover (epoch ≥ 2)", fin.GetStatus(), fin.GetEpoch(), fin.GetErrorMessage())
	}
	stored, err := r.client(b).GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(stored.GetRun(), fin) {
		t.Errorf("the watch's summary differs from GetRun's:\n%v\n%v", fin, stored.GetRun())
	}
	var after int
	for _, m := range got {
		if m.at.After(killedAt) && (m.msg.GetNode() != nil || m.msg.GetNodeEvent() != nil) {
			after++
		}
	}
	if after == 0 {
		t.Error("no node update or event after the kill: the watch did not follow the run to its new owner")
	}
	row, err := r.st.GetRun(ctx, md.DefaultTenant, id)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after the SIGKILL: %d node messages, the summary %v later (epoch %d, ended by %s)",
		after, got[len(got)-1].at.Sub(killedAt).Round(time.Millisecond), fin.GetEpoch(), row.Owner)
}

// tenantClient is a client of p with a new API key of tenant.
func tenantClient(ctx context.Context, t *testing.T, r *crashRig, p *meshproc.Proc, tenant string) orchestratorv1.OrchestratorServiceClient {
	t.Helper()
	k, err := apikey.New(tenant)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.st.CreateAPIKey(ctx, k.Record, false); err != nil {
		t.Fatal(err)
	}
	return tenantClientKey(t, p, k.Secret)
}
