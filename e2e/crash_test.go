package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// The crash drills: twenty runs, each with a kv_put and a notify around a
// long tool, and a process killed with SIGKILL in the middle. The cluster's processes are
// started by the test itself (curfew up stops the whole mesh when a child dies).

const (
	crashRuns = 20
	crashTTL  = time.Second // the orchestrators' lease TTL
)

// crashPlan: kv_put, then a 2 s sleep (the window the kill lands in), then notify.
func crashPlan(tag string, i int) string {
	return fmt.Sprintf(`{"tokens_per_second": 100, "steps": [
	  {"think_tokens": 5, "tools": [{"name": "kv_put", "args": {"key": "%s-%d", "value": {"run": %d}}}]},
	  {"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": 2000}}]},
	  {"think_tokens": 5, "tools": [{"name": "notify", "args": {"channel": "%s-%d", "message": "done %d"}}]},
	  {"answer_tokens": 3}]}`, tag, i, i, tag, i, i)
}

type crashRig struct {
	t                 *testing.T
	c                 *meshproc.Cluster
	st                store.Store
	model, sub, tools *meshproc.Proc
	tag               string
	runIDs            []string
}

func newCrashRig(t *testing.T, dsn string) *crashRig {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "curfew-crash-") // kept when the test fails, for the logs
	if err != nil {
		t.Fatal(err)
	}
	if dsn == "" {
		dsn = "sqlite://" + filepath.Join(dir, "curfew.db")
	}
	c, err := meshproc.NewCluster(t.Context(), dir, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("cluster: %v", err)
		}
		if t.Failed() {
			t.Logf("process logs are in %s", dir)
		} else {
			_ = os.RemoveAll(dir)
		}
	})
	r := &crashRig{t: t, c: c, tag: fmt.Sprintf("crash-%d", time.Now().UnixNano())}
	r.model, r.sub, r.tools, err = c.Mesh(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	r.st, err = store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.st.Close() })
	return r
}

func (r *crashRig) orchestrator(name string) *meshproc.Proc {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := r.c.Add(ctx, "orchestrator", name, r.c.OrchestratorArgs(r.model, r.sub, r.tools, "--lease-ttl", crashTTL.String())...)
	if err != nil {
		r.t.Fatal(err)
	}
	if err := p.Start(ctx); err != nil {
		r.t.Fatal(err)
	}
	return p
}

func (r *crashRig) client(p *meshproc.Proc) orchestratorv1.OrchestratorServiceClient {
	conn, err := r.c.Conn(p)
	if err != nil {
		r.t.Fatal(err)
	}
	return orchestratorv1.NewOrchestratorServiceClient(conn)
}

// start starts the runs as detached runs, spread over the orchestrators, each with an
// idempotency key, and returns once all have started.
func (r *crashRig) start(orchs ...*meshproc.Proc) {
	r.startPlans(func(i int) string { return crashPlan(r.tag, i) }, orchs...)
}

// startPlans is start with plan(i) as run i's task. It returns the requests, so that a
// test can repeat one (its idempotency key names the run).
func (r *crashRig) startPlans(plan func(i int) string, orchs ...*meshproc.Proc) []*orchestratorv1.StartRunRequest {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r.runIDs = make([]string, crashRuns)
	var wg sync.WaitGroup
	errs := make(chan error, crashRuns)
	reqs := make([]*orchestratorv1.StartRunRequest, crashRuns)
	for i := range crashRuns {
		oc := r.client(orchs[i%len(orchs)])
		reqs[i] = &orchestratorv1.StartRunRequest{Task: plan(i),
			IdempotencyKey: fmt.Sprintf("%s-%d", r.tag, i), Timeout: durationpb.New(40 * time.Second)}
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := oc.StartRun(ctx, reqs[i])
			if err != nil {
				errs <- fmt.Errorf("run %d: %w", i, err)
				return
			}
			r.runIDs[i] = resp.GetRun().GetRunId()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		r.t.Fatal(err)
	}
	return reqs
}

// waitStep waits until every run has recorded at least n checkpoints (n=3: kv_put's step
// is complete and the sleep step's model output is in: the runs are in their sleep).
func (r *crashRig) waitCheckpoints(n int) {
	r.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for _, id := range r.runIDs {
		for {
			cps, err := r.st.ListCheckpoints(context.Background(), md.DefaultTenant, id)
			if err == nil && len(cps) >= n {
				break
			}
			if time.Now().After(deadline) {
				r.t.Fatalf("run %s has %d checkpoints after 30s, want %d (%v)", id, len(cps), n, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// waitEnded waits until every run has ended in the store and returns them.
func (r *crashRig) waitEnded(within time.Duration) []store.Run {
	r.t.Helper()
	deadline := time.Now().Add(within)
	out := make([]store.Run, len(r.runIDs))
	for i, id := range r.runIDs {
		for {
			run, err := r.st.GetRun(context.Background(), md.DefaultTenant, id)
			if err == nil && run.Status.Terminal() {
				out[i] = run
				break
			}
			if time.Now().After(deadline) {
				r.t.Fatalf("run %d (%s) still %s after %v (%v)", i, id, run.Status, within, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return out
}

// check asserts the drill's outcome: every run succeeded; each kv_put and each notify
// took effect exactly once; no model step that had completed was generated again (the
// persisted ledger holds, for every checkpointed model step, exactly the checkpoint's
// tokens); and each run's checkpoints were written under non-decreasing epochs (no two
// owners interleaved). It returns how many runs were taken over (final epoch > 1).
func (r *crashRig) check(runs []store.Run) (takenOver int) {
	r.t.Helper()
	ctx := context.Background()
	for i, run := range runs {
		if run.Status != store.StatusSucceeded {
			r.t.Errorf("run %d (%s) ended %s: %s %s", i, run.RunID, run.Status, run.Cause, run.Error)
			continue
		}
		if run.Epoch > 1 {
			takenOver++
		}
		key := fmt.Sprintf("%s-%d", r.tag, i)
		kv, err := r.st.GetKV(ctx, md.DefaultTenant, key)
		if err != nil || kv.Version != 1 {
			r.t.Errorf("run %d: kv %s version %d (%v), want written once", i, key, kv.Version, err)
		}
		if rows := outboxFor(r.t, r.st, key); len(rows) != 1 {
			r.t.Errorf("run %d: %d notifications on %s, want exactly 1", i, len(rows), key)
		}
		cps, err := r.st.ListCheckpoints(ctx, md.DefaultTenant, run.RunID)
		if err != nil {
			r.t.Fatal(err)
		}
		var epochs []int64
		steps := map[string]int64{} // model node: its checkpoint's tokens
		for _, c := range cps {
			epochs = append(epochs, c.Epoch)
			if len(c.ModelOutput) == 0 {
				continue
			}
			e, err := agent.UnmarshalEntry(c.ModelOutput)
			if err != nil {
				r.t.Fatal(err)
			}
			steps[fmt.Sprintf("root/m%d", e.Step)] = c.Tokens
		}
		usage := r.ledger(run.RunID, steps)
		for node, tokens := range steps {
			if got := usage.ByNode[node]; got != tokens {
				r.t.Errorf("run %d: the ledger holds %d tokens for %s, its checkpoint %d: a completed model step was generated again",
					i, got, node, tokens)
			}
		}
		if len(cps) != 7 || !slices.IsSorted(epochs) || epochs[len(epochs)-1] > run.Epoch {
			r.t.Errorf("run %d: checkpoint epochs %v (run at epoch %d), want 7 in non-decreasing epochs", i, epochs, run.Epoch)
		}
	}
	return takenOver
}

// ledger reads the run's persisted token usage once it holds at least the tokens of
// every node in steps, or after 5 s: modelproxy appends a decoder's entries up to
// 20 ms after it ends (persistDelay), so the last step's may still be on their way
// when the run has ended.
func (r *crashRig) ledger(runID string, steps map[string]int64) store.Usage {
	r.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		usage, err := r.st.TokenUsage(context.Background(), md.DefaultTenant, runID)
		if err != nil {
			r.t.Fatal(err)
		}
		short := false
		for node, tokens := range steps {
			short = short || usage.ByNode[node] < tokens
		}
		if !short || time.Now().After(deadline) {
			return usage
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// An orchestrator killed mid-run and restarted: every run finishes, effects once, no
// completed model step regenerated.
func TestCrashOrchestratorRestarted(t *testing.T) {
	r := newCrashRig(t, "")
	o := r.orchestrator("orchestrator")
	r.start(o)
	r.waitCheckpoints(3)
	if err := o.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := o.Start(ctx); err != nil { // a new incarnation: a new owner
		t.Fatal(err)
	}
	runs := r.waitEnded(45 * time.Second)
	if n := r.check(runs); n != crashRuns {
		t.Errorf("%d of %d runs were taken over by the restarted orchestrator, want all", n, crashRuns)
	}
	t.Logf("all %d runs finished %v after the kill", crashRuns, time.Since(killed).Round(time.Millisecond))
}

// A toolrunner killed mid-tool and restarted: the same outcome. The runs' sleep calls
// fail UNAVAILABLE (and the orchestrator's breaker to toolrunner may open); each run
// resumes its step from its journal once toolrunner is back.
func TestCrashToolrunnerRestarted(t *testing.T) {
	r := newCrashRig(t, "")
	o := r.orchestrator("orchestrator")
	r.start(o)
	r.waitCheckpoints(3)
	if err := r.tools.Kill(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := r.tools.Start(ctx); err != nil {
		t.Fatal(err)
	}
	runs := r.waitEnded(45 * time.Second)
	if n := r.check(runs); n != 0 {
		t.Errorf("%d runs changed owner, want none: only toolrunner died", n)
	}
}

// Two orchestrators on one PostgreSQL, one killed: the other takes its runs over; no
// run is lost, and no run's checkpoints interleave two epochs.
func TestCrashTwoOrchestratorsOnPostgres(t *testing.T) {
	r := newCrashRig(t, storetest.PostgresDSN(t))
	a, b := r.orchestrator("orchestrator-a"), r.orchestrator("orchestrator-b")
	r.start(a, b)
	r.waitCheckpoints(3)
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	runs := r.waitEnded(45 * time.Second)
	n := r.check(runs)
	// Half the runs were a's: b took over each of them, and only them.
	if n != crashRuns/2 {
		t.Errorf("%d runs were taken over, want %d (orchestrator-a's)", n, crashRuns/2)
	}
	if !b.Running() {
		t.Error("orchestrator-b is not running")
	}
}
