package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// Settings of the memory benchmark.
const (
	// DefaultMemoryRuns is how many runs are put in flight; CURFEW_BENCH_RUNS overrides.
	DefaultMemoryRuns = 10000
	// memorySleepMS keeps every run's sleep tool going far longer than the benchmark.
	memorySleepMS = 600_000
	// memoryDeadline is each run's deadline: longer than starting all runs takes, within
	// the services' default maximum of 10 minutes.
	memoryDeadline = 9 * time.Minute
	// memoryConns client connections carry memoryWorkers concurrent starts.
	memoryConns   = 8
	memoryWorkers = 64
	// memorySettle is the pause before each memory reading.
	memorySettle = 3 * time.Second
)

var serviceNames = []string{"orchestrator", "toolrunner", "subagent", "modelproxy"}

// procStats is what is read of one service process at one instant.
type procStats struct {
	mem        Memory
	goroutines float64 // go_goroutines
	heapInuse  float64 // go_memstats_heap_inuse_bytes
	stackInuse float64 // go_memstats_stack_inuse_bytes
}

func readStats(tb testing.TB, m *meshproc.Mesh) map[string]procStats {
	tb.Helper()
	out := map[string]procStats{}
	for _, name := range serviceNames {
		ep := m.Endpoints.Services[name]
		mem, err := ReadMemory(ep.PID)
		if err != nil {
			tb.Fatal(err)
		}
		st := procStats{mem: mem}
		if text, err := scrape(ep.AdminAddr); err == nil {
			st.goroutines, _ = PromValue(text, "go_goroutines")
			st.heapInuse, _ = PromValue(text, "go_memstats_heap_inuse_bytes")
			st.stackInuse, _ = PromValue(text, "go_memstats_stack_inuse_bytes")
		}
		out[name] = st
	}
	return out
}

func scrape(admin string) (string, error) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + admin + "/metrics")
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// BenchmarkRunMemory measures the memory of in-flight runs, summed over the four service
// processes (the client is not counted): N runs (10,000; CURFEW_BENCH_RUNS) whose only
// tool call is a 10-minute sleep. Each mode starts a fresh mesh.
//
//   - detached: each run is started by Run with continue_on_disconnect=true, and the
//     client cancels its call as soon as the started event arrived, so only the run
//     remains (what a fleet of fire-and-forget clients leaves behind).
//   - attached: each Run call stays open, its events read, as a live client's would.
//
// It reads /proc/<pid>/smaps_rollup (Rss, Pss) and each service's go_goroutines and
// go_memstats_heap_inuse_bytes before the runs, after all N sleeps are running (seen in
// toolrunner's goroutine count), and again after checking every run's sleep node is
// RUNNING in toolrunner's NodeReportService. Reported per run: (after − before) / N.
// The benchmark runs once whatever -benchtime says.
func BenchmarkRunMemory(b *testing.B) {
	n := DefaultMemoryRuns
	if v := os.Getenv("CURFEW_BENCH_RUNS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			b.Fatalf("CURFEW_BENCH_RUNS=%q: want a positive integer", v)
		}
	}
	for _, mode := range []string{"detached", "attached"} {
		b.Run(mode, func(b *testing.B) {
			memoryOnce(b, n, mode == "attached") // once: b.N is not used

		})
	}
}

func memoryOnce(b *testing.B, n int, attached bool) {
	m := startMesh(b, "CURFEW_SHUTDOWN_GRACE=2s", "CURFEW_ADMISSION_CONFIG="+roomFor(b, n))
	orchs := make([]orchestratorv1.OrchestratorServiceClient, memoryConns)
	for i := range orchs {
		c, err := m.Conn("orchestrator")
		if err != nil {
			b.Fatal(err)
		}
		orchs[i] = orchestratorv1.NewOrchestratorServiceClient(c)
	}
	trConn, err := m.Conn("toolrunner")
	if err != nil {
		b.Fatal(err)
	}
	tools := meshv1.NewNodeReportServiceClient(trConn)
	ctx, cancelAll := context.WithCancel(context.Background())
	defer cancelAll()

	// Warm up connections and pools with short runs that complete.
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Go(func() {
			c, err := orchs[i%len(orchs)].Run(ctx, &orchestratorv1.RunRequest{Task: SleepPlan(10)})
			if err == nil {
				for {
					if _, err := c.Recv(); err != nil {
						break
					}
				}
			}
		})
	}
	wg.Wait()
	time.Sleep(memorySettle)
	before := readStats(b, m)
	saveProcFiles(b, m, attached, "before")

	// Start the runs.
	task := SleepPlan(memorySleepMS)
	ids := make([]string, n)
	var next atomic.Int64
	var startErr atomic.Value
	t0 := time.Now()
	for w := range memoryWorkers {
		wg.Go(func() {
			orch := orchs[w%len(orchs)]
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				id, err := startRun(ctx, orch, task, attached)
				if err != nil {
					startErr.CompareAndSwap(nil, err)
					return
				}
				ids[i] = id
			}
		})
	}
	wg.Wait()
	if err, _ := startErr.Load().(error); err != nil {
		b.Fatal("start runs: ", err)
	}
	startDur := time.Since(t0)

	// Wait until toolrunner holds all N sleeps: one Execute handler goroutine each.
	deadline := time.Now().Add(3 * time.Minute)
	for {
		text, err := scrape(m.Endpoints.Services["toolrunner"].AdminAddr)
		if err == nil {
			if g, ok := PromValue(text, "go_goroutines"); ok && g >= before["toolrunner"].goroutines+float64(n) {
				break
			}
		}
		if time.Now().After(deadline) {
			b.Fatal("the sleeps did not all start within 3 minutes")
		}
		time.Sleep(500 * time.Millisecond)
	}
	inflight := time.Since(t0)
	time.Sleep(memorySettle)
	after := readStats(b, m)
	saveProcFiles(b, m, attached, "after")
	saveProfiles(b, m, attached)

	// Prove it: every run's sleep node is running in toolrunner.
	running := verifySleeps(ctx, b, tools, ids)
	if running != n {
		b.Fatalf("%d of %d sleeps running in toolrunner", running, n)
	}
	time.Sleep(memorySettle)
	verified := readStats(b, m)

	mode := "detached"
	if attached {
		mode = "attached"
	}
	var sumRSS, sumPSS, sumRSSv float64
	for _, name := range serviceNames {
		d := float64(after[name].mem.RSS-before[name].mem.RSS) / float64(n)
		sumRSS += d
		sumPSS += float64(after[name].mem.PSS-before[name].mem.PSS) / float64(n)
		sumRSSv += float64(verified[name].mem.RSS-before[name].mem.RSS) / float64(n)
		b.ReportMetric(d/1024, name+"-KB/run")
	}
	b.ReportMetric(sumRSS/1024, "RSS-KB/run")
	b.ReportMetric(sumPSS/1024, "PSS-KB/run")
	b.ReportMetric(sumRSSv/1024, "RSS-after-verify-KB/run")
	printMemoryTable(mode, n, startDur, inflight, before, after, verified)
	cancelAll()
}

// startRun starts one run and returns its id. Detached, it cancels its call once the
// started event arrived; attached, it leaves the call open, read by a goroutine until ctx
// ends.
func startRun(ctx context.Context, orch orchestratorv1.OrchestratorServiceClient, task string, attached bool) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, memoryDeadline)
	st, err := orch.Run(cctx, &orchestratorv1.RunRequest{Task: task, ContinueOnDisconnect: !attached}, grpc.WaitForReady(true))
	if err != nil {
		cancel()
		return "", err
	}
	ev, err := st.Recv()
	if err != nil {
		cancel()
		return "", err
	}
	id := ev.GetStarted().GetRunId()
	if id == "" {
		cancel()
		return "", fmt.Errorf("first event is not started: %v", ev)
	}
	if !attached {
		cancel()
		return id, nil
	}
	go func() {
		defer cancel()
		for {
			if _, err := st.Recv(); err != nil {
				return
			}
		}
	}()
	return id, nil
}

// verifySleeps counts the runs whose sleep node (root/s0.t0) is RUNNING in toolrunner.
func verifySleeps(ctx context.Context, b *testing.B, tools meshv1.NodeReportServiceClient, ids []string) int {
	var running atomic.Int64
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(ids) {
					return
				}
				lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				resp, err := tools.ListNodes(lctx, &meshv1.ListNodesRequest{RunId: ids[i], NodePrefixes: []string{"root/s0.t0"}})
				cancel()
				if err != nil {
					b.Error(err)
					return
				}
				for _, nd := range resp.GetNodes() {
					if nd.GetId() == "root/s0.t0" && nd.GetName() == "sleep" && nd.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
						running.Add(1)
					}
				}
			}
		})
	}
	wg.Wait()
	return int(running.Load())
}

func printMemoryTable(mode string, n int, startDur, inflight time.Duration, before, after, verified map[string]procStats) {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nmemory per in-flight run, %s: %d runs started in %v, all sleeping after %v\n", mode, n, startDur.Round(time.Millisecond), inflight.Round(time.Millisecond))
	fmt.Fprintf(&sb, "| process | RSS before MiB | RSS after MiB | RSS KB/run | PSS KB/run | RSS KB/run after verify | heap in use KB/run | stacks KB/run | goroutines/run |\n")
	fmt.Fprintf(&sb, "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	names := append([]string(nil), serviceNames...)
	sort.Strings(names)
	var t [6]float64
	for _, name := range names {
		bf, af, vf := before[name], after[name], verified[name]
		row := [6]float64{
			float64(af.mem.RSS-bf.mem.RSS) / float64(n) / 1024,
			float64(af.mem.PSS-bf.mem.PSS) / float64(n) / 1024,
			float64(vf.mem.RSS-bf.mem.RSS) / float64(n) / 1024,
			(af.heapInuse - bf.heapInuse) / float64(n) / 1024,
			(af.stackInuse - bf.stackInuse) / float64(n) / 1024,
			(af.goroutines - bf.goroutines) / float64(n),
		}
		for i := range t {
			t[i] += row[i]
		}
		fmt.Fprintf(&sb, "| %s | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f |\n", name,
			float64(bf.mem.RSS)/(1<<20), float64(af.mem.RSS)/(1<<20), row[0], row[1], row[2], row[3], row[4], row[5])
	}
	fmt.Fprintf(&sb, "| **sum** | | | **%.1f** | %.1f | %.1f | %.1f | %.1f | %.2f |\n", t[0], t[1], t[2], t[3], t[4], t[5])
	addReport(sb.String())
}

// saveProfiles fetches heap and goroutine profiles of every service into
// CURFEW_BENCH_PPROF_DIR when it is set. The stock services do not serve /debug/pprof;
// docs/benchmarks.md describes the instrumented build this is for.
func saveProfiles(tb testing.TB, m *meshproc.Mesh, attached bool) {
	dir := os.Getenv("CURFEW_BENCH_PPROF_DIR")
	if dir == "" {
		return
	}
	mode := "detached"
	if attached {
		mode = "attached"
	}
	c := http.Client{Timeout: 30 * time.Second}
	for _, name := range serviceNames {
		for _, p := range []string{"heap", "goroutine"} {
			resp, err := c.Get("http://" + m.Endpoints.Services[name].AdminAddr + "/debug/pprof/" + p)
			if err != nil {
				tb.Log(err)
				continue
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				tb.Logf("%s /debug/pprof/%s: %v %s", name, p, err, resp.Status)
				continue
			}
			if err := os.WriteFile(fmt.Sprintf("%s/%s-%s-%s.pb.gz", dir, mode, name, p), body, 0o644); err != nil {
				tb.Log(err)
			}
		}
	}
}

// saveProcFiles saves, into CURFEW_BENCH_PPROF_DIR when it is set, what each service
// process says of its memory at one stage of the benchmark: /proc/<pid>/status and
// smaps_rollup, the admin port's /metrics and, with binaries that serve it,
// /debug/rtmetrics (runtime/metrics, one "name value" a line).
func saveProcFiles(tb testing.TB, m *meshproc.Mesh, attached bool, stage string) {
	dir := os.Getenv("CURFEW_BENCH_PPROF_DIR")
	if dir == "" {
		return
	}
	mode := "detached"
	if attached {
		mode = "attached"
	}
	c := http.Client{Timeout: 30 * time.Second}
	for _, name := range serviceNames {
		ep := m.Endpoints.Services[name]
		files := map[string][]byte{}
		for _, f := range []string{"status", "smaps_rollup", "smaps"} {
			if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/%s", ep.PID, f)); err == nil {
				files[f] = b
			}
		}
		for _, p := range []string{"metrics", "debug/rtmetrics", "debug/pprof/heap"} {
			resp, err := c.Get("http://" + ep.AdminAddr + "/" + p)
			if err != nil {
				continue
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err == nil && resp.StatusCode == http.StatusOK {
				files[strings.ReplaceAll(p, "/", "-")] = body
			}
		}
		for f, b := range files {
			if err := os.WriteFile(fmt.Sprintf("%s/%s-%s-%s-%s", dir, mode, stage, name, f), b, 0o644); err != nil {
				tb.Log(err)
			}
		}
	}
}

// roomFor writes an admission file that admits n runs in flight at once, started as fast
// as the workers can: the measured runs are one tenant's, far beyond the default pools'
// 512 in flight and 50 runs per second, which would queue and shed them.
func roomFor(b *testing.B, n int) string {
	b.Helper()
	cfg := fmt.Sprintf(`{"service": "orchestrator",
  "pools": [{"name": "paid", "max_in_flight": %d}, {"name": "overflow", "max_in_flight": 128, "overflow": true}],
  "default_tenant": {"rate": 1000000, "burst": 1000000, "request_rate": 1000000, "request_burst": 1000000}}`, n+64)
	p := filepath.Join(b.TempDir(), "admission.json")
	if err := os.WriteFile(p, []byte(cfg), 0o600); err != nil {
		b.Fatal(err)
	}
	return p
}
