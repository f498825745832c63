package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
)

// Hedging over real processes (issue 24's acceptance): a read-only tool whose calls take
// about 40 ms, 5 % of them 10× that, is called by the same runs through two
// orchestrators of one cluster, one without hedging and one with
// --hedge-max-extra-load 0.05. With hedging the p99 of the tool node's latency (the
// loop's own view) is at most half of the p99 without; the backups stay within
// max_extra_load of the calls plus the retry budget's floor; and no model call is
// hedged: modelproxy's Generate calls are exactly two per run.
func TestHedgedToolCallsCutTheTail(t *testing.T) {
	const (
		median  = 40 * time.Millisecond
		slow    = 10 * median
		runs    = 360 // per orchestrator
		warm    = 80  // the first runs, before the policy has its 50 samples, are not measured
		workers = 6
		load    = 0.05
	)
	var (
		mu      sync.Mutex
		rng     = rand.New(rand.NewPCG(24, 5)) //nolint:gosec // a test's latency distribution
		calls   atomic.Int64
		backups atomic.Int64
	)
	srv := toolserver.New(toolserver.Tool{Name: "read", Description: "Reads a record.", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
		Handler: func(ctx context.Context, c toolserver.Call, _ func(done, total float64, msg string)) (json.RawMessage, error) {
			n := calls.Add(1)
			if c.Hedge {
				backups.Add(1)
			}
			mu.Lock()
			d := median + time.Duration(rng.Int64N(int64(median/10)))
			mu.Unlock()
			if n%20 == 0 { // exactly 5 %: a random 5 % puts the p95 itself in the tail half the time
				d = slow
			}
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(d):
			}
			return json.RawMessage(`{"record": 1}`), nil
		}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "tools.json")
	if err := os.WriteFile(cfg, []byte(`{"sources": [{"name": "team", "kind": "grpc", "address": "`+lis.Addr().String()+`", "trusted": true}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := meshproc.NewCluster(t.Context(), dir, "sqlite://"+filepath.Join(dir, "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	model, sub, tools, err := c.Mesh(ctx, map[string][]string{"toolrunner": {"--tools-config", cfg}})
	if err != nil {
		t.Fatal(err)
	}
	orch := func(name string, extra ...string) (orchestratorv1.OrchestratorServiceClient, *meshproc.Proc) {
		// Admission off: the runs come faster than a tenant's default rate of starts.
		o, err := c.Add(ctx, "orchestrator", name, c.OrchestratorArgs(model, sub, tools, append(extra, "--admission-off")...)...)
		if err != nil {
			t.Fatal(err)
		}
		if err := o.Start(ctx); err != nil {
			t.Fatal(err)
		}
		conn, err := c.Conn(o)
		if err != nil {
			t.Fatal(err)
		}
		return orchestratorv1.NewOrchestratorServiceClient(conn), o
	}
	plain, _ := orch("orchestrator")
	hedged, hedgedProc := orch("orchestrator-hedged", "--hedge-max-extra-load", fmt.Sprint(load))
	waitForTool(ctx, t, plain, "team__read")

	genBefore := generates(t, model.AdminAddr)
	var shown [2]sync.Once // one hedged run's summary logged for each winner
	// phase runs the runs through o and returns the tool node's latencies of the measured
	// ones, sorted, and the tool server's calls and backups meanwhile.
	phase := func(o orchestratorv1.OrchestratorServiceClient) (lat []time.Duration, n, b int64) {
		calls.Store(0)
		backups.Store(0)
		out := make([]time.Duration, runs)
		var next atomic.Int64
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for i := int(next.Add(1)) - 1; i < runs; i = int(next.Add(1)) - 1 {
					res, _ := runPlan(ctx, o, oneToolPlan("team__read", `{}`, ""), 20*time.Second, 0, false)
					if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
						t.Errorf("run %d: %v %s", i, res.err, dump(res.finished))
						return
					}
					out[i] = toolLatency(t, res.nodes)
					if b, ok := nodeMap(res.finished)["root/s0.t0/hedge"]; ok {
						once := &shown[0] // the primary won
						if b.GetStatus() == meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
							once = &shown[1] // the backup won
						}
						once.Do(func() {
							tn := nodeMap(res.finished)["root/s0.t0"]
							t.Logf("a hedged run's summary: root/s0.t0 %v (cause %v), root/s0.t0/hedge %v (cause %v)",
								tn.GetStatus(), tn.GetCause(), b.GetStatus(), b.GetCause())
						})
					}
				}
			})
		}
		wg.Wait()
		lat = slices.Clone(out[warm:])
		slices.Sort(lat)
		return lat, calls.Load(), backups.Load()
	}
	p99 := func(l []time.Duration) time.Duration { return l[int(math.Ceil(0.99*float64(len(l))))-1] }

	latPlain, nPlain, bPlain := phase(plain)
	latHedged, nHedged, bHedged := phase(hedged)
	if t.Failed() {
		return
	}
	t.Logf("without hedging: p50 %v p99 %v, %d tool calls, %d backups", latPlain[len(latPlain)/2], p99(latPlain), nPlain, bPlain)
	t.Logf("with hedging:    p50 %v p99 %v, %d tool calls, %d backups (%.1f %% extra)", latHedged[len(latHedged)/2], p99(latHedged),
		nHedged, bHedged, 100*float64(bHedged)/float64(nHedged-bHedged))
	if bPlain != 0 || nPlain != runs {
		t.Errorf("without hedging the tool saw %d calls, %d of them backups; want %d and none", nPlain, bPlain, runs)
	}
	floor := int64(retry.DefaultBudgetPerSecond * retry.DefaultBudgetWindow.Seconds())
	if p99(latHedged) > p99(latPlain)/2 {
		t.Errorf("hedged p99 %v, want at most half of the unhedged %v", p99(latHedged), p99(latPlain))
	}
	if limit := int64(math.Ceil(load*runs)) + floor; bHedged > limit || nHedged != runs+bHedged {
		t.Errorf("%d backups for %d runs (%d calls), want at most max_extra_load × runs + the budget's floor = %d", bHedged, runs, nHedged, limit)
	}
	page := metricsPage(t, hedgedProc)
	// (A backup cancelled before toolrunner forwarded it was sent, but the tool never saw it.)
	sent := page.value("curfew_hedges_sent_total", map[string]string{"tool": "team__read"}, false)
	if int64(sent) < bHedged || int64(sent) > int64(math.Ceil(load*runs))+floor {
		t.Errorf("curfew_hedges_sent_total %v, the tool saw %d backups: want at least those, within the bound", sent, bHedged)
	}
	won := page.value("curfew_hedges_won_total", map[string]string{"tool": "team__read"}, false)
	t.Logf("backups won: %v of %d", won, bHedged)
	if won == 0 {
		t.Error("no backup ever won")
	}
	// No model call was hedged: two Generate calls per run (the tool step, the answer).
	if got := generates(t, model.AdminAddr) - genBefore; got != 4*runs {
		t.Errorf("modelproxy served %v Generate calls for 2 × %d runs of two model steps, want exactly %d: a model call was hedged or retried", got, runs, 4*runs)
	}
}

// toolLatency is the tool node's latency as the loop reported it (its start and end).
func toolLatency(t *testing.T, ns []*meshv1.Node) time.Duration {
	t.Helper()
	for _, n := range ns {
		if n.GetId() == "root/s0.t0" && n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_SUCCEEDED && n.GetEndedAt() != nil {
			return n.GetEndedAt().AsTime().Sub(n.GetStartedAt().AsTime())
		}
	}
	t.Errorf("no succeeded tool node among %d node events", len(ns))
	return 0
}

// generates is modelproxy's count of Generate calls served.
func generates(t *testing.T, admin string) float64 {
	t.Helper()
	body, err := httpGet("http://" + admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	return parsePage(t, body).value("grpc_server_handled_total",
		map[string]string{"grpc_service": "curfew.modelproxy.v1.ModelProxyService", "grpc_method": "Generate"}, false)
}

// metricsPage reads p's /metrics.
func metricsPage(t *testing.T, p *meshproc.Proc) page {
	t.Helper()
	body, err := httpGet("http://" + p.AdminAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	return parsePage(t, body)
}

// waitForTool runs one-tool plans through o until toolrunner knows tool (its source
// lists in the background), so that the measured runs find it.
func waitForTool(ctx context.Context, t *testing.T, o orchestratorv1.OrchestratorServiceClient, tool string) {
	t.Helper()
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		res, _ := runPlan(ctx, o, oneToolPlan(tool, `{}`, ""), 10*time.Second, 0, false)
		if res.err == nil && res.finished.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("%s never answered: %v %s", tool, res.err, dump(res.finished))
		}
	}
}
