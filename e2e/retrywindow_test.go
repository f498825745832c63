package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// downTools is a toolrunner that is down: every Execute fails UNAVAILABLE (ListTools is
// unimplemented, so the orchestrators fall back to the built-in tools). It records when
// it received a retry (curfew-attempt > 1), by run.
type downTools struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	mu      sync.Mutex
	firsts  int
	retries map[string][]time.Time // by run id
}

func (d *downTools) Execute(_ *toolrunnerv1.ExecuteRequest, ss grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]) error {
	now := time.Now()
	in, _ := metadata.FromIncomingContext(ss.Context())
	run, attempt := "", ""
	if v := in.Get(md.RunID); len(v) > 0 {
		run = v[0]
	}
	if v := in.Get(md.Attempt); len(v) > 0 {
		attempt = v[0]
	}
	d.mu.Lock()
	if attempt != "" && attempt != "1" {
		d.retries[run] = append(d.retries[run], now)
	} else {
		d.firsts++
	}
	d.mu.Unlock()
	return status.Error(codes.Unavailable, "toolrunner is down")
}

// retryRun is a run of one replica's retries with no gap longer than the split.
type retryRun struct {
	replica     string
	first, last time.Time
}

// retryRuns cuts each replica's retries into runs: a gap longer than split starts a new
// one. A run covers every retry in it, so two replicas retrying at one moment always
// show as overlapping runs, whatever the split.
func retryRuns(byReplica map[string][]time.Time, split time.Duration) []retryRun {
	var out []retryRun
	for r, ts := range byReplica {
		sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
		cur := retryRun{replica: r, first: ts[0], last: ts[0]}
		for _, t := range ts[1:] {
			if t.Sub(cur.last) > split {
				out = append(out, cur)
				cur = retryRun{replica: r, first: t}
			}
			cur.last = t
		}
		out = append(out, cur)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].first.Before(out[j].first) })
	return out
}

// overlapPeak is the most replicas whose retry runs overlap at one moment.
func overlapPeak(rs []retryRun) int {
	peak := 0
	for _, a := range rs {
		n := map[string]bool{}
		for _, b := range rs {
			if !b.first.After(a.first) && !b.last.Before(a.first) {
				n[b.replica] = true
			}
		}
		peak = max(peak, len(n))
	}
	return peak
}

// TestRetryWindowsAcrossOrchestrators is issue 24's acceptance for coordinated retries
// (item 3) on real processes: three orchestrators on one PostgreSQL store, whose
// toolrunner is a dependency in this process that always fails UNAVAILABLE. It records
// the retries it receives by caller replica (a run's owner), and at no moment do more
// than N = 1 replicas send retries (the others wait for the window); over the test the
// window moves to more than one of them. Breakers are off: they are not what this test is about.
func TestRetryWindowsAcrossOrchestrators(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn := storetest.PostgresDSN(t)
	c := newCluster(ctx, t, "retrywindow", dsn)
	dir := c.Dir

	dep := &downTools{retries: map[string][]time.Time{}}
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	toolrunnerv1.RegisterToolRunnerServiceServer(srv, dep)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	const length = 2 * time.Second
	retryCfg := filepath.Join(dir, "retry.json")
	if err := os.WriteFile(retryCfg, []byte(fmt.Sprintf(`{"window": {"replicas": 1, "length": %q}}`, length)), 0o600); err != nil {
		t.Fatal(err)
	}
	model, err := c.Add(ctx, "modelproxy", "modelproxy", "--store", dsn)
	if err != nil {
		t.Fatal(err)
	}
	if err := model.Start(ctx); err != nil {
		t.Fatal(err)
	}
	names := []string{"orchestrator-a", "orchestrator-b", "orchestrator-c"}
	clients := make([]orchestratorv1.OrchestratorServiceClient, len(names))
	for i, n := range names {
		p, err := c.Add(ctx, "orchestrator", n, "--store", dsn, "--modelproxy", model.Addr,
			"--toolrunner", lis.Addr().String(), "--subagent", lis.Addr().String(),
			"--retry-config", retryCfg, "--breaker-off")
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Start(ctx); err != nil {
			t.Fatal(err)
		}
		conn, err := c.Conn(p)
		if err != nil {
			t.Fatal(err)
		}
		clients[i] = orchestratorv1.NewOrchestratorServiceClient(conn)
	}

	// Runs whose every step calls a tool, back to back, 3 at a time per orchestrator,
	// for several window lengths.
	var steps []string
	for range 40 {
		steps = append(steps, `{"think_tokens": 1, "tools": [{"name": "sleep", "args": {"ms": 1}}]}`)
	}
	plan := `{"tokens_per_second": 1000, "steps": [` + strings.Join(steps, ",") + `, {"answer_tokens": 1}]}`
	var mu sync.Mutex
	owner := map[string]string{} // run id → replica
	runs := map[string]int{}
	var wg sync.WaitGroup
	end := time.Now().Add(5 * length)
	for i, cl := range clients {
		for range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(end) && ctx.Err() == nil {
					rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
					st, err := cl.Run(rctx, &orchestratorv1.RunRequest{Task: plan})
					if err != nil {
						rcancel()
						t.Errorf("%s: run: %v", names[i], err)
						return
					}
					for {
						ev, err := st.Recv()
						if err != nil {
							break
						}
						if s := ev.GetStarted(); s != nil {
							mu.Lock()
							owner[s.GetRunId()] = names[i]
							runs[names[i]]++
							mu.Unlock()
						}
					}
					rcancel()
				}
			}()
		}
	}
	wg.Wait()

	dep.mu.Lock()
	defer dep.mu.Unlock()
	mu.Lock()
	defer mu.Unlock()
	byReplica := map[string][]time.Time{}
	total := 0
	for run, ts := range dep.retries {
		r, ok := owner[run]
		if !ok {
			t.Fatalf("retries of an unknown run %q", run)
		}
		byReplica[r] = append(byReplica[r], ts...)
		total += len(ts)
	}
	rs := retryRuns(byReplica, length/4)
	peak := overlapPeak(rs)
	perReplica := map[string]int{}
	for r, ts := range byReplica {
		perReplica[r] = len(ts)
	}
	t.Logf("runs by replica %v; the dependency saw %d first attempts and %d retries, by replica %v, in %d retry runs; peak %d replicas retrying at once",
		runs, dep.firsts, total, perReplica, len(rs), peak)
	if peak > 1 {
		for _, r := range rs {
			t.Logf("%s retried from %s to %s", r.replica, r.first.Format("15:04:05.000"), r.last.Format("15:04:05.000"))
		}
		t.Fatalf("%d replicas sent retries at once; the window allows 1", peak)
	}
	if len(byReplica) < 2 {
		t.Fatalf("retries came from %d replica(s): the window never moved", len(byReplica))
	}
	// Replicas without a window wait for it rather than retry (peak above); each call
	// still makes at most the policy's attempts.
	if most := 2 * dep.firsts; total > most {
		t.Fatalf("%d first attempts and %d retries: more than 2 retries per call", dep.firsts, total)
	}
}
