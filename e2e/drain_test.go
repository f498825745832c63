package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// The graceful drain (docs/leases.md#drain): SIGTERM to an orchestrator that is running runs,
// with a second orchestrator on the same PostgreSQL.
const (
	drainDelay = 2 * time.Second
	drainGrace = 2 * time.Second
	// The runs' sleeps: the short ones end during the drain, on the draining
	// orchestrator; the long ones outlast it and must be handed over.
	drainShortSleep = 1500 * time.Millisecond
	drainLongSleep  = 8 * time.Second
)

// drainPlan is crashPlan's shape (kv_put, sleep, notify, answer: seven checkpoints) with
// the sleep's length chosen per run.
func drainPlan(tag string, i int, sleep time.Duration) string {
	return fmt.Sprintf(`{"tokens_per_second": 100, "steps": [
	  {"think_tokens": 5, "tools": [{"name": "kv_put", "args": {"key": "%s-%d", "value": {"run": %d}}}]},
	  {"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": %d}}]},
	  {"think_tokens": 5, "tools": [{"name": "notify", "args": {"channel": "%s-%d", "message": "done %d"}}]},
	  {"answer_tokens": 3}]}`, tag, i, i, sleep.Milliseconds(), tag, i, i)
}

func drainSleep(i int) time.Duration {
	if i%2 == 0 {
		return drainShortSleep
	}
	return drainLongSleep
}

func isDraining(err error) bool {
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == "DRAINING" && ei.GetDomain() == "curfew.dev" {
			return true
		}
	}
	return false
}

// SIGTERM to an orchestrator running twenty runs, with a second one on the same
// PostgreSQL: its health turns NOT_SERVING at once, it refuses new runs (UNAVAILABLE,
// DRAINING) while it still serves, it exits within --drain-delay + --shutdown-grace + the
// flush, and no run is lost: the runs that end during the drain end there, the others are
// handed over to the second orchestrator through their leases and end there; every
// kv_put and notify takes effect exactly once.
func TestDrainHandsRunsOverOnSIGTERM(t *testing.T) {
	r := newCrashRig(t, storetest.PostgresDSN(t))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	orch := func(name string, extra ...string) *meshproc.Proc {
		p, err := r.c.Add(ctx, "orchestrator", name, r.c.OrchestratorArgs(r.model, r.sub, r.tools,
			append([]string{"--lease-ttl", crashTTL.String()}, extra...)...)...)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Start(ctx); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a := orch("orchestrator-a", "--drain-delay", drainDelay.String(), "--shutdown-grace", drainGrace.String())
	b := orch("orchestrator-b")
	ac, bc := r.client(a), r.client(b)
	conn, err := r.c.Conn(a)
	if err != nil {
		t.Fatal(err)
	}
	health := healthpb.NewHealthClient(conn)

	// Twenty detached runs on a, each with an idempotency key.
	reqs := r.startPlans(func(i int) string { return drainPlan(r.tag, i, drainSleep(i)) }, a)
	r.waitCheckpoints(3) // every run is in (or past) its sleep
	if resp, err := health.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("a's health before SIGTERM = %v, %v", resp.GetStatus(), err)
	}

	signalled := time.Now()
	stopped := make(chan error, 1)
	go func() { stopped <- a.Stop(time.Minute) }()

	// Health goes NOT_SERVING at once, answered by the server still listening.
	for {
		cctx, stop := context.WithTimeout(ctx, time.Second)
		resp, err := health.Check(cctx, &healthpb.HealthCheckRequest{})
		stop()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_NOT_SERVING {
			break
		}
		if d := time.Since(signalled); err != nil || d > 500*time.Millisecond {
			t.Fatalf("a's health %v after SIGTERM = %v, %v; want NOT_SERVING at once", d, resp.GetStatus(), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	notServing := time.Since(signalled)
	// A new run is refused for another replica; a repeated StartRun gets its run.
	_, lateErr := ac.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: drainPlan(r.tag+"-late", 0, time.Millisecond),
		IdempotencyKey: r.tag + "-late"})
	again, againErr := ac.StartRun(ctx, reqs[1])
	if d := time.Since(signalled); d >= drainDelay {
		t.Fatalf("the checks during the drain took %v, beyond the drain delay %v: the machine is too slow for this test", d, drainDelay)
	}
	if status.Code(lateErr) != codes.Unavailable || !isDraining(lateErr) {
		t.Errorf("StartRun on a during the drain = %v, want UNAVAILABLE with ErrorInfo DRAINING", lateErr)
	}
	if againErr != nil || again.GetCreated() || again.GetRun().GetRunId() != r.runIDs[1] {
		t.Errorf("repeated StartRun during the drain = %v created=%v, want run %s", againErr, again.GetCreated(), r.runIDs[1])
	}

	// a exits within the one bound.
	bound := drainDelay + drainGrace + service.StopFlush
	select {
	case err := <-stopped:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(bound + 10*time.Second):
		t.Fatalf("orchestrator-a still running %v after SIGTERM", time.Since(signalled))
	}
	exited := time.Since(signalled)
	if exited < drainDelay || exited > bound+3*time.Second {
		t.Errorf("orchestrator-a exited %v after SIGTERM, want after the drain delay %v and within the bound %v (+3s)", exited, drainDelay, bound)
	}

	// No run lost: each succeeded, read through b.
	runs := r.waitEnded(60 * time.Second)
	handed := 0
	for i, id := range r.runIDs {
		resp, err := bc.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
		if err != nil {
			t.Fatalf("GetRun %d on b: %v", i, err)
		}
		run := resp.GetRun()
		if run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Errorf("run %d (%s) ended %v: %s", i, id, run.GetStatus(), run.GetErrorMessage())
		}
		switch {
		case run.GetEpoch() > 1:
			handed++
			if drainSleep(i) == drainShortSleep {
				t.Errorf("run %d, which ends during the drain, was handed over (epoch %d)", i, run.GetEpoch())
			}
		case drainSleep(i) == drainLongSleep:
			t.Errorf("run %d, which outlasts the drain, ended at epoch %d: not handed over", i, run.GetEpoch())
		}
	}
	// Effects once, no completed model step generated again, epochs never interleaved.
	if n := r.check(runs); n != handed || handed != crashRuns/2 {
		t.Errorf("%d runs taken over (store), %d (GetRun); want the %d long ones", n, handed, crashRuns/2)
	}
	if !b.Running() {
		t.Error("orchestrator-b is not running")
	}
	if b, err := os.ReadFile(filepath.Join(r.c.Dir, "orchestrator-a.log")); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if strings.Contains(line, `"msg":"drain`) || strings.Contains(line, `"msg":"stop`) {
				t.Log("orchestrator-a: " + line)
			}
		}
	}
	t.Logf("health NOT_SERVING %v after SIGTERM; exited after %v (bound %v); %d runs handed over; all done %v after SIGTERM",
		notServing.Round(time.Millisecond), exited.Round(time.Millisecond), bound, handed, time.Since(signalled).Round(time.Millisecond))
}
