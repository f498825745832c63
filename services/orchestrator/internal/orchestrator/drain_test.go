package orchestrator

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// wantDraining fails unless err is UNAVAILABLE with the DRAINING ErrorInfo.
func wantDraining(t *testing.T, err error, contains string) {
	t.Helper()
	meshtest.WantCode(t, err, codes.Unavailable, contains)
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == DrainingReason && ei.GetDomain() == "curfew.dev" {
			return
		}
	}
	t.Fatalf("error %v has no ErrorInfo %s", err, DrainingReason)
}

func TestHandoverPoint(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct{ window, margin time.Duration }{
		{25 * time.Second, 2 * time.Second},       // capped
		{3 * time.Second, 600 * time.Millisecond}, // a fifth
		{300 * time.Millisecond, 100 * time.Millisecond},
		{50 * time.Millisecond, 50 * time.Millisecond}, // never before now
		{0, 0},
		{-time.Second, -time.Second}, // a deadline passed: at once
	} {
		if got := handoverPoint(now, now.Add(tc.window)); !got.Equal(now.Add(tc.window - tc.margin)) {
			t.Errorf("window %v: handover %v after now, want %v", tc.window, got.Sub(now), tc.window-tc.margin)
		}
	}
}

// During the drain no new run starts, a key that names a run of this process still gets
// it, and reads go on.
func TestDrainRefusesNewRuns(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	ctx := context.Background()
	req := &orchestratorv1.StartRunRequest{Task: slowPlan, IdempotencyKey: "k", Timeout: durationpb.New(20 * time.Second)}
	first, err := e.orch.StartRun(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	e.waitDecoder(t)
	if e.srv.Draining() {
		t.Fatal("draining before Drain")
	}
	e.srv.Drain(time.Now().Add(20 * time.Second))
	if !e.srv.Draining() {
		t.Fatal("not draining after Drain")
	}

	_, err = e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: tinyPlan, IdempotencyKey: "new"})
	wantDraining(t, err, "orchestrator is draining; retry on another replica")
	_, err = e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: tinyPlan})
	wantDraining(t, err, "draining")
	st, err := e.orch.Run(ctx, &orchestratorv1.RunRequest{Task: tinyPlan})
	if err == nil {
		_, err = st.Recv()
	}
	wantDraining(t, err, "draining")
	// Invalid requests are still told so.
	_, err = e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{})
	meshtest.WantCode(t, err, codes.InvalidArgument)

	again, err := e.orch.StartRun(ctx, req)
	if err != nil || again.GetCreated() || again.GetRun().GetRunId() != first.GetRun().GetRunId() {
		t.Fatalf("StartRun with the key of a run here: %v created=%v run %s, want run %s", err, again.GetCreated(),
			again.GetRun().GetRunId(), first.GetRun().GetRunId())
	}
	_, err = e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: tinyPlan, IdempotencyKey: "k"})
	meshtest.WantCode(t, err, codes.AlreadyExists)

	got, err := e.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: first.GetRun().GetRunId()})
	if err != nil || got.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
		t.Fatalf("GetRun during the drain: %v %v, want the run, still running", err, got.GetRun().GetStatus())
	}
	list, err := e.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
	if err != nil || len(list.GetRuns()) != 1 {
		t.Fatalf("ListRuns during the drain: %v, %d runs", err, len(list.GetRuns()))
	}
}

// sleepPlan: a short think, a sleep of ms (cancellable), an answer.
func sleepPlan(ms int) string {
	return fmt.Sprintf(`{"tokens_per_second":200,"steps":[
	  {"think_tokens":2,"tools":[{"name":"sleep","args":{"ms":%d}}]},
	  {"answer_tokens":2}]}`, ms)
}

// At the handover point a draining orchestrator hands its runs over through their leases:
// an attached Run stream ends UNAVAILABLE (the run moved; follow it with WatchRun), a
// WatchRun still polling ends UNAVAILABLE with DRAINING, and another orchestrator on the
// store resumes both runs from their checkpoints; they succeed there.
func TestDrainHandsRunsOver(t *testing.T) {
	st := openStore(t)
	a := newDurableEnv(t, st, "orch-a", time.Second)
	ctx := context.Background()
	detached, err := a.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: sleepPlan(2000), Timeout: durationpb.New(30 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	attached, started := a.start(ctx, t, &orchestratorv1.RunRequest{Task: sleepPlan(2001)})
	ids := []string{detached.GetRun().GetRunId(), started.GetRunId()}
	for _, id := range ids { // both in their sleep: step 0's model output is recorded
		for until := time.Now().Add(5 * time.Second); ; {
			cps, _ := st.ListCheckpoints(ctx, md.DefaultTenant, id)
			if len(cps) == 1 {
				break
			}
			if time.Now().After(until) {
				t.Fatalf("run %s: %d checkpoints, want step 0's model output", id, len(cps))
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	b := newDurableEnv(t, st, "orch-b", time.Second)

	begin := time.Now()
	by := begin.Add(time.Second) // handover point: 800ms
	a.srv.Drain(by)
	_, err = a.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: tinyPlan})
	wantDraining(t, err, "draining")

	_, err = attached.rest()
	ended := time.Since(begin)
	meshtest.WantCode(t, err, codes.Unavailable, "moved to another orchestrator", "WatchRun")
	if ended < 700*time.Millisecond || ended > 3*time.Second {
		t.Errorf("the attached stream ended %v after the drain began, want at the handover point (800ms)", ended)
	}
	w, err := a.orch.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: detached.GetRun().GetRunId()})
	if err != nil {
		t.Fatal(err)
	}
	evs, err := meshtest.Drain(w)
	if err != nil {
		wantDraining(t, err, "watch run")
	} else if evs[len(evs)-1].GetFinished().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("WatchRun on the drained orchestrator: %v", evs[len(evs)-1])
	}

	for _, id := range ids {
		r := b.waitEndedTenant(t, md.DefaultTenant, id)
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || r.GetEpoch() != 2 {
			t.Errorf("run %s ended %v at epoch %d (%s), want SUCCEEDED, taken over at epoch 2", id, r.GetStatus(), r.GetEpoch(), r.GetErrorMessage())
		}
		cps, err := st.ListCheckpoints(ctx, md.DefaultTenant, id)
		if err != nil {
			t.Fatal(err)
		}
		var epochs []int64
		for _, c := range cps {
			epochs = append(epochs, c.Epoch)
		}
		if !slices.Equal(epochs, []int64{1, 2, 2}) {
			t.Errorf("run %s: checkpoint epochs %v, want step 0's model output by a, the rest by b", id, epochs)
		}
	}
	start := time.Now()
	a.srv.Shutdown(by)
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Errorf("Shutdown with every run handed over took %v", d)
	}
}
