package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/meshproc"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Settings of the throughput benchmark; CURFEW_BENCH_THROUGHPUT_RUNS and
// CURFEW_BENCH_THROUGHPUT_CONC override the first two. curfew's runs ask for the started
// event and the summary alone (RUN_EVENTS_SUMMARY), what the bare orchestrator sends;
// CURFEW_BENCH_THROUGHPUT_EVENTS=all streams them every node update and event instead.
const (
	throughputRuns = 200 // runs per side per round
	throughputConc = 4   // runs in flight at once
	// throughputSettle is the pause after a block's last run before its CPU is read, so
	// that work a run leaves behind (curfew's batched ledger appends, say) is counted
	// with the block that caused it. Both sides get it.
	throughputSettle = 300 * time.Millisecond
)

// throughputBlock is one side's figures over one block of runs.
type throughputBlock struct {
	runs   int
	wall   time.Duration
	procs  [4]time.Duration // CPU per service process, indexed as serviceNames
	client time.Duration    // this process's CPU (the benchmark's clients)
}

// throughputRound is one round: curfew's block, the bare tree's, and the load average
// (1, 5, 15 min) at its end.
type throughputRound struct {
	sides [2]throughputBlock // curfew, bare
	load  string
}

func (x throughputBlock) cpu() time.Duration {
	var s time.Duration
	for _, c := range x.procs {
		s += c
	}
	return s
}

// BenchmarkThroughput measures the CPU a run costs, summed over the four service
// processes, for SmallPlan (two model steps of 50 tokens at 10,000 tokens/s, two 1 ms
// sleep tools) on the real mesh (`curfew up --insecure`: plaintext, so that the
// comparison is about curfew's policies; mTLS has its own section), against the same
// plan on the bare tree (startBareTree: the same four processes and messages on bare
// grpc-go). Each iteration is one round: a block of runs on each side, the order
// alternating, throughputConc runs in flight, the CPU of each side's processes read
// before and throughputSettle after its block. Run it with -benchtime=<rounds>x.
//
// Metrics: CPU per run (µs, the four processes), its ratio to the bare tree's (issue 26:
// at most 1.3×), runs per second per core (1 / CPU per run), and wall-clock runs/s.
func BenchmarkThroughput(b *testing.B) {
	runs, conc := envInt(b, "CURFEW_BENCH_THROUGHPUT_RUNS", throughputRuns), envInt(b, "CURFEW_BENCH_THROUGHPUT_CONC", throughputConc)
	// One pool without tenant limits: the default admission lets a tenant start 50 runs
	// per second, which these runs exceed; the benchmark measures the mesh, not its shedding.
	admission := filepath.Join(b.TempDir(), "admission.json")
	if err := os.WriteFile(admission, []byte(`{"pools": [{"name": "bench", "max_in_flight": 64, "max_queue": 64, "max_queue_age": "30s"}]}`), 0o600); err != nil {
		b.Fatal(err)
	}
	m := startMeshWith(b, meshproc.Options{Insecure: true, Args: []string{"--admission-config", admission}})
	orch, err := m.Orchestrator()
	if err != nil {
		b.Fatal(err)
	}
	var curfewPIDs [4]int
	for i, name := range serviceNames {
		curfewPIDs[i] = m.Endpoints.Services[name].PID
	}
	bare := startBareTree(b, 10000, false)
	task := SmallPlan()
	ctx := context.Background()
	events := orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY
	if os.Getenv("CURFEW_BENCH_THROUGHPUT_EVENTS") == "all" {
		events = orchestratorv1.RunEvents_RUN_EVENTS_ALL
	}
	curfewRun := func() error { return meshRunWithin(ctx, orch, task, events, 30*time.Second) }
	bareRun := func() error {
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		return bare.run(rctx, task)
	}
	for _, warm := range []func() error{curfewRun, bareRun} { // warm-up: connections, heaps, the store's pages
		if _, err := throughputOnce(b, warm, 50, conc, [4]int{}); err != nil {
			b.Fatal(err)
		}
	}
	if dir := os.Getenv("CURFEW_BENCH_PPROF_DIR"); dir != "" {
		// Where curfew's CPU goes, for docs/benchmarks.md: a CPU profile of every service
		// over one block of runs, made before the measured rounds so that it costs them
		// nothing. The services serve profiles with CURFEW_PPROF=true in the environment.
		stop := cpuProfiles(b, m, dir, 5*time.Second)
		if _, err := throughputOnce(b, curfewRun, runs, conc, [4]int{}); err != nil {
			b.Fatal(err)
		}
		stop()
	}
	var rounds []throughputRound
	for b.Loop() {
		var r throughputRound
		order := []int{0, 1}
		if len(rounds)%2 == 1 {
			order = []int{1, 0}
		}
		for _, side := range order {
			run, pids := curfewRun, curfewPIDs
			if side == 1 {
				run, pids = bareRun, bare.pids
			}
			x, err := throughputOnce(b, run, runs, conc, pids)
			if err != nil {
				b.Fatal(err)
			}
			r.sides[side] = x
		}
		r.load = loadAvg()
		rounds = append(rounds, r)
	}
	var sum [2]throughputBlock
	for _, r := range rounds {
		for s, x := range r.sides {
			sum[s].runs += x.runs
			sum[s].wall += x.wall
			sum[s].client += x.client
			for i := range x.procs {
				sum[s].procs[i] += x.procs[i]
			}
		}
	}
	perRun := func(x throughputBlock) float64 { return float64(x.cpu()) / float64(x.runs) }
	b.ReportMetric(perRun(sum[0])/1e3, "cpu-per-run-curfew-µs")
	b.ReportMetric(perRun(sum[1])/1e3, "cpu-per-run-bare-µs")
	b.ReportMetric(perRun(sum[0])/perRun(sum[1]), "curfew/bare-x")
	b.ReportMetric(1e9/perRun(sum[0]), "runs/s/core-curfew")
	b.ReportMetric(1e9/perRun(sum[1]), "runs/s/core-bare")
	b.ReportMetric(float64(sum[0].runs)/sum[0].wall.Seconds(), "runs/s-curfew")
	b.ReportMetric(float64(sum[1].runs)/sum[1].wall.Seconds(), "runs/s-bare")
	printThroughputTable(rounds, conc)
}

// meshRunWithin makes one Run call of task on the mesh, streaming events, with a deadline
// within from now, and reads it to its end; a run that did not succeed is an error.
func meshRunWithin(ctx context.Context, orch orchestratorv1.OrchestratorServiceClient, task string, events orchestratorv1.RunEvents, within time.Duration) error {
	rctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	return runToEnd(rctx, orch, task, events)
}

// runToEnd makes one Run call of task on orch (the mesh's or the bare tree's, which
// ignores events) and reads it to its end: an error unless the run succeeded.
func runToEnd(ctx context.Context, orch orchestratorv1.OrchestratorServiceClient, task string, events orchestratorv1.RunEvents) error {
	st, err := orch.Run(ctx, &orchestratorv1.RunRequest{Task: task, Events: events})
	if err != nil {
		return err
	}
	for {
		ev, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if f := ev.GetFinished(); f != nil && f.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			return fmt.Errorf("run %s ended %v: %s", f.GetRunId(), f.GetStatus(), f.GetErrorMessage())
		}
	}
}

// throughputOnce makes n runs, conc at a time, and returns the block's figures; pids
// are the side's service processes (zero: not measured, for the warm-up).
func throughputOnce(b *testing.B, run func() error, n, conc int, pids [4]int) (throughputBlock, error) {
	x := throughputBlock{runs: n}
	var cpu0 [4]time.Duration
	if pids[0] != 0 {
		var err error
		if cpu0, err = cpuTimes(pids); err != nil {
			return x, err
		}
	}
	client0 := processCPU(b)
	t0 := time.Now()
	jobs := make(chan struct{}, n)
	for range n {
		jobs <- struct{}{}
	}
	close(jobs)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	for range conc {
		wg.Go(func() {
			for range jobs {
				if err := run(); err != nil {
					mu.Lock()
					first = cmp.Or(first, err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	x.wall = time.Since(t0)
	if first != nil {
		return x, first
	}
	time.Sleep(throughputSettle)
	x.client = processCPU(b) - client0
	if pids[0] != 0 {
		cpu1, err := cpuTimes(pids)
		if err != nil {
			return x, err
		}
		for i := range cpu1 {
			x.procs[i] = cpu1[i] - cpu0[i]
		}
	}
	return x, nil
}

func printThroughputTable(rounds []throughputRound, conc int) {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nthroughput: SmallPlan, %d in flight, CPU of the four service processes per run (µs), curfew (plaintext) and the bare tree alternating\n", conc)
	fmt.Fprintf(&sb, "| round | runs | curfew CPU/run | orch / tool / sub / model | bare CPU/run | orch / tool / sub / model | curfew/bare | curfew runs/s | bare runs/s | client CPU/run curfew / bare | load |\n")
	fmt.Fprintf(&sb, "|---:|---:|---:|---|---:|---|---:|---:|---:|---|---|\n")
	per := func(d time.Duration, n int) string { return us(d / time.Duration(n)) }
	split := func(x throughputBlock) string {
		parts := make([]string, len(x.procs))
		for i, c := range x.procs {
			parts[i] = per(c, x.runs)
		}
		return strings.Join(parts, " / ")
	}
	for i, r := range rounds {
		c, bb := r.sides[0], r.sides[1]
		fmt.Fprintf(&sb, "| %d | %d | %s | %s | %s | %s | %.2f | %.0f | %.0f | %s / %s | %s |\n", i+1, c.runs,
			per(c.cpu(), c.runs), split(c), per(bb.cpu(), bb.runs), split(bb),
			float64(c.cpu())/float64(c.runs)/(float64(bb.cpu())/float64(bb.runs)),
			float64(c.runs)/c.wall.Seconds(), float64(bb.runs)/bb.wall.Seconds(),
			per(c.client, c.runs), per(bb.client, bb.runs), r.load)
	}
	addReport(sb.String())
}

// cpuProfiles fetches a CPU profile of d from every service of m into dir (as
// <service>-cpu.pb.gz), in the background; the function it returns waits for them.
func cpuProfiles(b *testing.B, m *meshproc.Mesh, dir string, d time.Duration) func() {
	var wg sync.WaitGroup
	for _, name := range serviceNames {
		wg.Go(func() {
			c := http.Client{Timeout: d + 30*time.Second}
			resp, err := c.Get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", m.Endpoints.Services[name].AdminAddr, int(d.Seconds())))
			if err != nil {
				b.Log(err)
				return
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err != nil || resp.StatusCode != http.StatusOK {
				b.Logf("%s CPU profile: %v %s (is CURFEW_PPROF=true set?)", name, err, resp.Status)
				return
			}
			if err := os.WriteFile(filepath.Join(dir, name+"-cpu.pb.gz"), body, 0o644); err != nil {
				b.Log(err)
			}
		})
	}
	return wg.Wait
}
