package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
)

// capDependency is the test's own tool service that the paid runs call: it keeps the
// high-water mark of calls in flight (each run makes one call, so: of runs in flight
// past admission), and a "hold" tool that blocks until released.
type capDependency struct {
	inFlight, high atomic.Int64
	mu             sync.Mutex
	runs           map[string]bool
	held           atomic.Int64
	release        chan struct{}
}

func startCapDependency(t *testing.T) (*capDependency, string) {
	t.Helper()
	d := &capDependency{runs: map[string]bool{}, release: make(chan struct{})}
	srv := toolserver.New(
		toolserver.Tool{Name: "work", Description: "Does 20 ms of work.", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
			Handler: func(ctx context.Context, c toolserver.Call, _ func(done, total float64, msg string)) (json.RawMessage, error) {
				n := d.inFlight.Add(1)
				defer d.inFlight.Add(-1)
				for h := d.high.Load(); n > h && !d.high.CompareAndSwap(h, n); h = d.high.Load() {
				}
				d.mu.Lock()
				d.runs[c.RunID] = true
				d.mu.Unlock()
				select {
				case <-time.After(20 * time.Millisecond):
				case <-ctx.Done():
				}
				return json.RawMessage(`"done"`), nil
			}},
		toolserver.Tool{Name: "hold", Description: "Waits until the test releases it.", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
			Handler: func(ctx context.Context, _ toolserver.Call, _ func(done, total float64, msg string)) (json.RawMessage, error) {
				d.held.Add(1)
				defer d.held.Add(-1)
				select {
				case <-d.release:
				case <-ctx.Done():
				}
				return json.RawMessage(`"released"`), nil
			}})
	lis, err := new(net.ListenConfig).Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	return d, lis.Addr().String()
}

// replicaPair starts two replicas of service on one port of 127.0.0.1 and 127.0.0.2,
// behind a DNS name that resolves to both (two pods of a headless Service), and returns
// the dns:/// target and the processes, not started.
func replicaPair(ctx context.Context, t *testing.T, c *meshproc.Cluster, service string, args ...string) (string, []*meshproc.Proc) {
	t.Helper()
	l, err := new(net.ListenConfig).Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	name := service + ".curfew.test"
	target := "dns://" + serveDNS(t, name, "127.0.0.1", "127.0.0.2") + "/" + name + ":" + strconv.Itoa(port)
	var ps []*meshproc.Proc
	for i, ip := range []string{"127.0.0.1", "127.0.0.2"} {
		p, err := c.AddAt(ctx, service, service+"-"+string(rune('a'+i)), net.JoinHostPort(ip, strconv.Itoa(port)), args...)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	return target, ps
}

// runOnce runs req on oc to its summary, with deadline d.
func runOnce(ctx context.Context, oc orchestratorv1.OrchestratorServiceClient, req *orchestratorv1.RunRequest, d time.Duration) (*orchestratorv1.Run, error) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	st, err := oc.Run(ctx, req)
	if err != nil {
		return nil, err
	}
	for {
		ev, err := st.Recv()
		if err != nil {
			return nil, err
		}
		if fin := ev.GetFinished(); fin != nil {
			return fin, nil
		}
	}
}

// Issue 24's first acceptance: three orchestrators, two replicas of every other service,
// one PostgreSQL. 200 concurrent critical runs against a paid cap of 2, spread over the
// three orchestrators, each calling a dependency that keeps the high-water mark of runs
// in flight: it never exceeds 2, and every run succeeds. Then a SIGKILLed orchestrator
// holding both slots: a run queued on another is admitted within TTL + 1 s of the kill.
func TestClusterAdmissionCapAcrossThreeOrchestrators(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	oc := newOpsBase(ctx, t, "cluster-cap")
	c := oc.Cluster
	dep, depAddr := startCapDependency(t)
	toolsFile := filepath.Join(c.Dir, "tools.json")
	writeFile(t, toolsFile, `{"sources": [{"name": "dep", "kind": "grpc", "address": "`+depAddr+`", "trusted": true}]}`)

	modelTarget, models := replicaPair(ctx, t, c, "modelproxy", "--store", c.Store)
	subTarget, subs := replicaPair(ctx, t, c, "subagent", "--modelproxy", modelTarget)
	toolTarget, tools := replicaPair(ctx, t, c, "toolrunner", "--store", c.Store, "--subagent", subTarget, "--tools-config", toolsFile)
	for _, s := range subs {
		s.Args = append(s.Args, "--toolrunner", toolTarget)
	}
	for _, p := range append(append(models, subs...), tools...) {
		if err := p.Start(ctx); err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
	}
	const ttl = 2 * time.Second
	adm := filepath.Join(c.Dir, "admission.json")
	writeFile(t, adm, `{"pools": [{"name": "paid", "max_in_flight": 2, "max_queue": 512, "max_queue_age": "4m"},
	  {"name": "overflow", "max_in_flight": 8, "overflow": true}]}`)
	for _, n := range []string{"orchestrator-a", "orchestrator-b", "orchestrator-c"} {
		oc.addOrchestrator(ctx, t, n, "--store", c.Store, "--modelproxy", modelTarget, "--toolrunner", toolTarget, "--subagent", subTarget,
			"--admission-config", adm, "--cluster-slot-ttl", ttl.String(), "--cluster-replicas", "3")
	}
	// toolrunner lists the source in the background: wait until a run can call it.
	const work = `{"tokens_per_second": 1000, "steps": [{"tools": [{"name": "dep__work", "args": {}}]}, {"answer_tokens": 1}]}`
	waitFor(t, "toolrunner lists dep__work", time.Minute, func() bool {
		fin, err := runOnce(ctx, oc.runs[0], &orchestratorv1.RunRequest{Task: work}, 30*time.Second)
		return err == nil && fin.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED
	})
	dep.high.Store(0)

	const runs = 200
	var wg sync.WaitGroup
	errs := make(chan error, runs)
	start := time.Now()
	for i := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fin, err := runOnce(ctx, oc.runs[i%3], &orchestratorv1.RunRequest{Task: work}, 4*time.Minute)
			switch {
			case err != nil:
				errs <- fmt.Errorf("run %d on orchestrator %d: %w", i, i%3, err)
			case fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED:
				errs <- fmt.Errorf("run %d on orchestrator %d ended %v: %s", i, i%3, fin.GetStatus(), fin.GetErrorMessage())
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	high := dep.high.Load()
	t.Logf("%d runs over 3 orchestrators against a paid cap of 2 in %v: high-water mark of runs in flight %d",
		runs, time.Since(start).Round(time.Millisecond), high)
	if high > 2 || high < 1 {
		t.Fatalf("high-water mark of paid runs in flight = %d, want at most the cap 2 (and at least 1)", high)
	}
	dep.mu.Lock()
	seen := len(dep.runs)
	dep.mu.Unlock()
	if seen < runs {
		t.Fatalf("the dependency saw %d runs, want %d", seen, runs)
	}
	out, code := oc.cli(ctx, t, 1, "status")
	if code != 0 || !strings.Contains(out, "cluster admission coordinated") || !strings.Contains(out, "CLUSTER") {
		t.Fatalf("curfew status (exit %d) does not show cluster-wide admission:\n%s", code, out)
	}

	// Orchestrator c holds both slots with two runs blocked in the dependency; a third
	// run queues on a. c is SIGKILLed: its slots come back within TTL + 1 s and a's run
	// is admitted.
	const hold = `{"tokens_per_second": 1000, "steps": [{"tools": [{"name": "dep__hold", "args": {}}]}, {"answer_tokens": 1}]}`
	for range 2 {
		if _, err := oc.runs[2].StartRun(ctx, &orchestratorv1.StartRunRequest{Task: hold, Timeout: durationpb.New(time.Minute)}); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "c's two runs in the dependency", 30*time.Second, func() bool { return dep.held.Load() == 2 })
	// StartRun returns once the run is admitted: a's waits in its queue.
	type started struct {
		resp *orchestratorv1.StartRunResponse
		err  error
	}
	admitted := make(chan started, 1)
	go func() {
		resp, err := oc.runs[0].StartRun(ctx, &orchestratorv1.StartRunRequest{Task: work, Timeout: durationpb.New(time.Minute)})
		admitted <- started{resp, err}
	}()
	waitFor(t, "a's run queued", 30*time.Second, func() bool {
		st, err := oc.admins[0].Status(ctx, &adminv1.StatusRequest{})
		return err == nil && len(st.GetPools()) > 0 && st.GetPools()[0].GetQueued() == 1
	})
	cPID := strconv.Itoa(oc.orchs[2].PID())
	aPID := strconv.Itoa(oc.orchs[0].PID())
	heldBy := func(pid string) int {
		slots, err := oc.st.ListSlots(ctx, admission.PoolScope("paid"))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, s := range slots {
			if s.Held(time.Now()) && strings.Contains(s.Holder, "-"+pid+"-") {
				n++
			}
		}
		return n
	}
	if n := heldBy(cPID); n != 2 {
		slots, _ := oc.st.ListSlots(ctx, admission.PoolScope("paid"))
		out, _ := oc.cli(ctx, t, 2, "status")
		t.Fatalf("orchestrator c (pid %s; a %s, b %d) holds %d paid slots, want 2: %+v\n%s", cPID, aPID, oc.orchs[1].PID(), n, slots, out)
	}
	if err := oc.orchs[2].Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	close(dep.release) // c's runs, taken over elsewhere, end
	// StartRun returns once the run is admitted, that is once a has claimed a paid slot.
	// (Polling the slots instead can miss the claim: the run ends, and its slot goes back,
	// within a few tens of milliseconds.)
	var queued started
	select {
	case queued = <-admitted:
	case <-time.After(30 * time.Second):
		t.Fatalf("a's queued run not admitted within 30s of c's death (a holds %d paid slots)", heldBy(aPID))
	}
	took := time.Since(killed)
	t.Logf("a's queued run was admitted %v after c was killed (slot TTL %v)", took.Round(time.Millisecond), ttl)
	if took > ttl+time.Second {
		t.Errorf("a dead replica's slots came back after %v, want within TTL + 1 s = %v", took, ttl+time.Second)
	}
	if queued.err != nil {
		t.Fatalf("a's queued run: %v", queued.err)
	}
	if fin, err := waitRun(ctx, oc.runs[0], queued.resp.GetRun().GetRunId()); err != nil || fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("the queued run: %v %v", fin.GetStatus(), err)
	}
}

// waitRun follows run id to its summary.
func waitRun(ctx context.Context, oc orchestratorv1.OrchestratorServiceClient, id string) (*orchestratorv1.Run, error) {
	st, err := oc.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		return nil, err
	}
	for {
		ev, err := st.Recv()
		if err != nil {
			return nil, err
		}
		if fin := ev.GetFinished(); fin != nil {
			return fin, nil
		}
	}
}
