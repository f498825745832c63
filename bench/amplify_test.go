package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// Settings of the retry-amplification benchmark (docs/benchmarks.md, "Retry
// amplification").
var ampTree = AmpTree{
	Depth:      2,   // root → subagent → subagent; the leaves are the level-2 model steps
	Fanout:     2,   // 2 × 2 = 4 leaves and 6 subagents per run
	Rate:       0.3, // every model attempt and every fail-tool attempt fails UNAVAILABLE with p = 0.3
	FailTool:   true,
	LeafTokens: 4,
	TPS:        1000,
}

// ampProbe is a chain root → subagent → subagent → leaf whose leaf fails every attempt:
// how many attempts one failing leaf costs when every layer above may retry.
var ampProbe = AmpTree{Depth: 2, Fanout: 1, LeafTokens: 1, TPS: 1000, LeafAlwaysFails: true}

const (
	// ampNaiveConfig is the naive mesh's retry file: every layer retries up to 3 attempts,
	// errors retried below are retried again, no budget.
	ampNaiveConfig = `{"naive": true, "default": {"max_attempts": 3}}`
	// ampRunDeadline is each Run call's deadline, far longer than a run.
	ampRunDeadline = time.Minute
	// ampWarmup fault-free runs per mesh open the connections before the measurement;
	// ampQuiet after them lets the retry budget's 10 s window forget them.
	ampWarmup = 8
	ampQuiet  = 11 * time.Second
	// ampSteady is where the steady state starts: runs started this long after the
	// measurement began, when the budget's 10 s window holds only measured traffic.
	ampSteady = 10 * time.Second
	// ampSettle bounds the wait for a run's nodes to be reported ended.
	ampSettle = 10 * time.Second
	// ampProbeRuns is how many probe runs each mesh runs.
	ampProbeRuns = 3
	// ampReaders read the runs' nodes in parallel after the measurement.
	ampReaders = 8
)

var ampModes = []string{"curfew", "naive"}

// ampHop is one retrying hop: the caller process, the target and the streaming method.
type ampHop struct{ caller, target, method string }

var ampHops = []ampHop{
	{"orchestrator", "modelproxy", modelproxyv1.ModelProxyService_Generate_FullMethodName},
	{"orchestrator", "toolrunner", toolrunnerv1.ToolRunnerService_Execute_FullMethodName},
	{"toolrunner", "subagent", subagentv1.SubagentService_Spawn_FullMethodName},
	{"subagent", "modelproxy", modelproxyv1.ModelProxyService_Generate_FullMethodName},
	{"subagent", "toolrunner", toolrunnerv1.ToolRunnerService_Execute_FullMethodName},
}

func (h ampHop) String() string {
	return h.caller + "→" + h.target + " " + h.method[strings.LastIndexByte(h.method, '/')+1:]
}

// ampRun is one root run.
type ampRun struct {
	start time.Time
	id    string
	ok    bool
	code  string // "OK", the run's status and error code, or the Run call's code when it never started
	dur   time.Duration
	model []*meshv1.Node // modelproxy's decoder nodes of the run
	subs  []*meshv1.Node // the subagent service's nodes
	tools []*meshv1.Node // toolrunner's nodes
}

// ampSide is one mesh of a cell.
type ampSide struct {
	mode    string
	m       *meshproc.Mesh
	orch    orchestratorv1.OrchestratorServiceClient
	reports map[string]meshv1.NodeReportServiceClient
	pids    map[string]int    // service → pid
	admins  map[string]string // service → admin address

	mu    sync.Mutex // guards runs
	runs  []ampRun
	probe []ampRun
	// /metrics of every service when the measurement began, when the steady state began
	// (ampSteady later) and when the last run ended.
	before, mid, after map[string]string
	cpu                map[string]time.Duration // service → CPU used during the measurement
	wall               time.Duration            // measurement began → this side's last run ended
}

// ampLoad is how a cell drives each mesh: Conc root runs always in flight (closed loop),
// or, when Rate > 0, a new root run every 1/Rate seconds whatever is in flight (open loop).
type ampLoad struct {
	Conc int
	Rate float64
}

// Name is the sub-benchmark name: "conc=16" or "rate=4".
func (l ampLoad) Name() string {
	if l.Rate > 0 {
		return "rate=" + strconv.FormatFloat(l.Rate, 'f', -1, 64)
	}
	return "conc=" + strconv.Itoa(l.Conc)
}

// parseAmpLoads parses "rate=4,conc=2,conc=16".
func parseAmpLoads(v string) ([]ampLoad, error) {
	var out []ampLoad
	for _, f := range strings.Split(v, ",") {
		k, val, _ := strings.Cut(strings.TrimSpace(f), "=")
		x, err := strconv.ParseFloat(val, 64)
		switch {
		case err != nil || x <= 0:
			return nil, fmt.Errorf("%q: want conc=N or rate=R with a positive number", f)
		case k == "conc" && x == math.Trunc(x):
			out = append(out, ampLoad{Conc: int(x)})
		case k == "rate":
			out = append(out, ampLoad{Rate: x})
		default:
			return nil, fmt.Errorf("%q: want conc=N (an integer) or rate=R", f)
		}
	}
	return out, nil
}

// ampCell is one load's result.
type ampCell struct {
	load      ampLoad
	dur       time.Duration // how long runs were started
	t0        time.Time     // the measurement began
	sides     []*ampSide
	busy      time.Duration // machine busy time during the measurement
	othersCPU time.Duration // of which every other process of the machine
	wall      time.Duration
	load0     string
	load1     string
}

var ampCells []ampCell

// BenchmarkRetryAmplification measures retry amplification with 30 % UNAVAILABLE
// injected at every layer of a 3-level tree (root → 2 subagents → 2 subagents each → a
// leaf decoder in modelproxy each; every model step of every level, and a fail tool beside
// every level's spawns, fail each attempt with p = 0.3), curfew's defaults against the
// naive policy (3 attempts per hop, errors retried below retried again, no budget). The
// two meshes run at the same time, each driven by the same load for
// CURFEW_BENCH_AMP_SECONDS (default 60 s), so that machine noise hits both alike.
//
// Per mode: attempts per logical call at the leaf (a leaf node id of a run; its attempts
// are all the Generate attempts modelproxy recorded for that id, 1 + len(earlier_attempts),
// whichever retry-id they carried, so that a subtree re-run by an upper layer counts too),
// total leaf attempts per root run, the success rate of root runs (Wilson 95 % interval),
// and per hop the calls, retries and budget refusals from every service's /metrics.
// Figures are reported for the steady state (runs started ≥ 10 s in, when the retry
// budget's window holds only measured traffic) and for all runs.
//
// Sub-benchmarks are loads (CURFEW_BENCH_AMP_LOADS, default "rate=4,conc=2,conc=16"):
// rate=R starts R root runs per second per mesh (open loop), conc=N keeps N in flight per
// mesh (closed loop). The budget is a rate (20 % of calls plus 10 retries/s per client and
// target over 10 s), so whether it binds depends on the call rate. Each cell starts two
// fresh meshes. CURFEW_BENCH_RAW=dir writes per-run and per-leaf CSVs.
func BenchmarkRetryAmplification(b *testing.B) {
	dur := time.Duration(envInt(b, "CURFEW_BENCH_AMP_SECONDS", 60)) * time.Second
	spec := "rate=4,conc=2,conc=16"
	if v := os.Getenv("CURFEW_BENCH_AMP_LOADS"); v != "" {
		spec = v
	}
	loads, err := parseAmpLoads(spec)
	if err != nil {
		b.Fatal("CURFEW_BENCH_AMP_LOADS: ", err)
	}
	cfg := filepath.Join(b.TempDir(), "naive-retry.json")
	if err := os.WriteFile(cfg, []byte(ampNaiveConfig), 0o644); err != nil {
		b.Fatal(err)
	}
	ampCells = nil
	for _, load := range loads {
		b.Run(load.Name(), func(b *testing.B) {
			// Fresh meshes per cell: budgets and counters start empty.
			sides := []*ampSide{
				newAmpSide(b, ampModes[0], startMesh(b, "CURFEW_SHUTDOWN_GRACE=2s")),
				newAmpSide(b, ampModes[1], startMesh(b, "CURFEW_SHUTDOWN_GRACE=2s", "CURFEW_RETRY_CONFIG="+cfg)),
			}
			var cell ampCell
			for b.Loop() {
				c, err := ampMeasure(context.Background(), sides, load, dur)
				if err != nil {
					b.Fatal(err)
				}
				cell = c
			}
			for _, s := range cell.sides {
				st := s.stats(cell.steady(s))
				b.ReportMetric(st.leafAttempts.Mean(), s.mode+"-leaf-attempts/call")
				b.ReportMetric(100*float64(st.ok)/float64(max(st.runs, 1)), s.mode+"-success-%")
			}
			ampCells = append(ampCells, cell)
			if err := writeAmpRaw(cell); err != nil {
				b.Log("raw samples: ", err)
			}
		})
	}
	printAmpTables(ampCells)
}

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

func newAmpSide(b *testing.B, mode string, m *meshproc.Mesh) *ampSide {
	s := &ampSide{mode: mode, m: m, reports: map[string]meshv1.NodeReportServiceClient{},
		pids: map[string]int{}, admins: map[string]string{}}
	var err error
	if s.orch, err = m.Orchestrator(); err != nil {
		b.Fatal(err)
	}
	for _, svc := range []string{"modelproxy", "subagent", "toolrunner"} {
		if s.reports[svc], err = m.Report(svc); err != nil {
			b.Fatal(err)
		}
	}
	for name, e := range m.Endpoints.Services {
		s.pids[name], s.admins[name] = e.PID, e.AdminAddr
	}
	return s
}

// ampMeasure drives every side with load, all sides at once, starting runs for dur; then
// reads every run's nodes, then runs the probe.
func ampMeasure(ctx context.Context, sides []*ampSide, load ampLoad, dur time.Duration) (ampCell, error) {
	cell := ampCell{load: load, dur: dur, sides: sides}
	// Warm-up: open the connections with fault-free runs, then let the budget window pass.
	warm := ampTree
	warm.Rate = 0
	for _, s := range sides {
		for range ampWarmup {
			if r := ampRunOnce(ctx, s.orch, warm.Plan()); !r.ok {
				return cell, fmt.Errorf("%s: warm-up run %s ended %s", s.mode, r.id, r.code)
			}
		}
	}
	time.Sleep(ampQuiet)

	task := ampTree.Plan()
	cpu0 := map[*ampSide]map[string]time.Duration{}
	for _, s := range sides {
		s.runs, s.probe, s.cpu = nil, nil, map[string]time.Duration{}
		var err error
		if s.before, err = scrapeAll(s.admins); err != nil {
			return cell, err
		}
		if cpu0[s], err = cpuOf(s.pids); err != nil {
			return cell, err
		}
	}
	cell.load0 = loadavg()
	busy0, err := MachineBusy()
	if err != nil {
		return cell, err
	}
	t0 := time.Now()
	cell.t0 = t0
	midErr := make(chan error, 1)
	mid := time.AfterFunc(ampSteady, func() {
		var err error
		for _, s := range sides {
			var e error
			s.mid, e = scrapeAll(s.admins)
			err = errors.Join(err, e)
		}
		midErr <- err
	})
	var wg sync.WaitGroup
	for _, s := range sides {
		var sw sync.WaitGroup
		record := func() {
			r := ampRunOnce(ctx, s.orch, task)
			s.mu.Lock()
			s.runs = append(s.runs, r)
			s.mu.Unlock()
		}
		if load.Rate > 0 {
			sw.Add(1)
			go func() { // open loop: the i-th run starts at t0 + i/Rate
				defer sw.Done()
				for i := 0; ; i++ {
					at := t0.Add(time.Duration(float64(i) / load.Rate * float64(time.Second)))
					if at.Sub(t0) >= dur {
						return
					}
					time.Sleep(time.Until(at))
					sw.Add(1)
					go func() {
						defer sw.Done()
						record()
					}()
				}
			}()
		} else {
			for range load.Conc {
				sw.Add(1)
				go func() { // closed loop
					defer sw.Done()
					for time.Since(t0) < dur {
						record()
					}
				}()
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sw.Wait()
			s.wall = time.Since(t0)
		}()
	}
	wg.Wait()
	cell.wall = time.Since(t0)
	busy1, err := MachineBusy()
	if err != nil {
		return cell, err
	}
	cell.load1 = loadavg()
	cell.busy = busy1 - busy0
	cell.othersCPU = cell.busy
	for _, s := range sides {
		cpu1, err := cpuOf(s.pids)
		if err != nil {
			return cell, err
		}
		for name, d := range cpu1 {
			s.cpu[name] = d - cpu0[s][name]
			cell.othersCPU -= s.cpu[name]
		}
		if s.after, err = scrapeAll(s.admins); err != nil {
			return cell, err
		}
	}
	if !mid.Stop() { // it ran (dur > ampSteady)
		if err := <-midErr; err != nil {
			return cell, err
		}
	}
	// Every run's nodes, from the executors' own records.
	for _, s := range sides {
		if err := s.readAll(ctx, s.runs); err != nil {
			return cell, err
		}
	}
	// The probe, once the budget window has forgotten the measured runs.
	time.Sleep(ampQuiet)
	for _, s := range sides {
		for range ampProbeRuns {
			r := ampRunOnce(ctx, s.orch, ampProbe.Plan())
			if r.ok {
				return cell, fmt.Errorf("%s: probe run %s succeeded; its leaf always fails", s.mode, r.id)
			}
			s.probe = append(s.probe, r)
		}
		if err := s.readAll(ctx, s.probe); err != nil {
			return cell, err
		}
	}
	return cell, nil
}

// readAll reads the nodes of runs, ampReaders at a time.
func (s *ampSide) readAll(ctx context.Context, runs []ampRun) error {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
		next = make(chan *ampRun)
	)
	for range ampReaders {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range next {
				if err := s.readNodes(ctx, r); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		}()
	}
	for i := range runs {
		next <- &runs[i]
	}
	close(next)
	wg.Wait()
	return errors.Join(errs...)
}

// readNodes reads run r's nodes from modelproxy, the subagent service and toolrunner.
func (s *ampSide) readNodes(ctx context.Context, r *ampRun) error {
	if r.id == "" {
		return nil
	}
	for svc, dst := range map[string]*[]*meshv1.Node{"modelproxy": &r.model, "subagent": &r.subs, "toolrunner": &r.tools} {
		lctx, cancel := context.WithTimeout(ctx, ampSettle+5*time.Second)
		resp, err := s.reports[svc].ListNodes(lctx, &meshv1.ListNodesRequest{RunId: r.id, SettleTimeout: durationpb.New(ampSettle)})
		cancel()
		if err != nil {
			return fmt.Errorf("%s: %s ListNodes of run %s: %w", s.mode, svc, r.id, err)
		}
		if !resp.GetSettled() {
			return fmt.Errorf("%s: run %s still has running nodes on %s %v after it ended", s.mode, r.id, svc, ampSettle)
		}
		*dst = resp.GetNodes()
	}
	return nil
}

// ampRunOnce runs task to its end, reading the Run stream as a client would.
func ampRunOnce(ctx context.Context, orch orchestratorv1.OrchestratorServiceClient, task string) ampRun {
	start := time.Now()
	r := ampRun{start: start}
	rctx, cancel := context.WithTimeout(ctx, ampRunDeadline)
	defer cancel()
	st, err := orch.Run(rctx, &orchestratorv1.RunRequest{Task: task})
	if err != nil {
		r.code, r.dur = "call:"+status.Code(err).String(), time.Since(start)
		return r
	}
	var fin *orchestratorv1.Run
	for {
		ev, err := st.Recv()
		if err != nil {
			if fin == nil {
				r.code = "call:" + status.Code(err).String()
				if errors.Is(err, io.EOF) {
					r.code = "call:EOF without a summary"
				}
			}
			break
		}
		if s := ev.GetStarted(); s != nil {
			r.id = s.GetRunId()
		}
		if f := ev.GetFinished(); f != nil {
			fin = f
		}
	}
	r.dur = time.Since(start)
	if fin != nil {
		r.ok = fin.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED
		r.code = "OK"
		if !r.ok {
			r.code = strings.TrimPrefix(fin.GetStatus().String(), "RUN_STATUS_") + ":" + fin.GetErrorCode()
		}
	}
	return r
}

// ampStats are one side's figures over some of its runs.
type ampStats struct {
	runs, ok     int
	leafAttempts Ints // per leaf logical call (leaf node id of a run)
	leafRetryIDs Ints // distinct retry-ids per leaf node id: > 1 means an upper layer re-ran the subtree
	leafPerRun   Ints // leaf attempts per root run
	modelPerRun  Ints // model attempts of every level per root run
	upper        Ints // attempts per non-leaf model call
	subAttempts  Ints // attempts per subagent node (subagent service)
	spawnAtt     Ints // attempts per spawn_subagent tool node (toolrunner)
	failAtt      Ints // attempts per fail tool node (toolrunner)
	durs         Dist
	leafOutcome  map[string]int // final status of the leaf logical calls
	runOutcome   map[string]int
}

// stats computes the figures over runs.
func (s *ampSide) stats(runs []ampRun) ampStats {
	st := ampStats{runs: len(runs), leafOutcome: map[string]int{}, runOutcome: map[string]int{}}
	for _, r := range runs {
		if r.ok {
			st.ok++
		}
		st.runOutcome[r.code]++
		st.durs = append(st.durs, r.dur)
		leafSum, model := 0, 0
		for _, nd := range r.model {
			a := 1 + len(nd.GetEarlierAttempts())
			model += a
			if NodeDepth(nd.GetId()) < ampTree.Depth {
				st.upper = append(st.upper, a)
				continue
			}
			st.leafAttempts = append(st.leafAttempts, a)
			st.leafRetryIDs = append(st.leafRetryIDs, retryIDs(nd))
			st.leafOutcome[strings.TrimPrefix(nd.GetStatus().String(), "NODE_STATUS_")]++
			leafSum += a
		}
		st.leafPerRun = append(st.leafPerRun, leafSum)
		st.modelPerRun = append(st.modelPerRun, model)
		for _, nd := range r.subs {
			if nd.GetKind() == meshv1.NodeKind_NODE_KIND_SUBAGENT {
				st.subAttempts = append(st.subAttempts, 1+len(nd.GetEarlierAttempts()))
			}
		}
		for _, nd := range r.tools {
			switch nd.GetName() {
			case plan.ToolSpawnSubagent:
				st.spawnAtt = append(st.spawnAtt, 1+len(nd.GetEarlierAttempts()))
			case plan.ToolFail:
				st.failAtt = append(st.failAtt, 1+len(nd.GetEarlierAttempts()))
			}
		}
	}
	return st
}

// retryIDs counts the distinct retry-ids of a node's attempts.
func retryIDs(nd *meshv1.Node) int {
	ids := map[string]bool{nd.GetRetryId(): true}
	for _, e := range nd.GetEarlierAttempts() {
		ids[e.GetRetryId()] = true
	}
	return len(ids)
}

// steady returns s's runs started at least ampSteady after the measurement began.
func (c ampCell) steady(s *ampSide) []ampRun {
	out := []ampRun{}
	for _, r := range s.runs {
		if r.start.Sub(c.t0) >= ampSteady {
			out = append(out, r)
		}
	}
	return out
}

func scrapeAll(admins map[string]string) (map[string]string, error) {
	out := map[string]string{}
	c := http.Client{Timeout: 10 * time.Second}
	for name, a := range admins {
		resp, err := c.Get("http://" + a + "/metrics") //nolint:noctx // bounded by the client's timeout
		if err != nil {
			return nil, fmt.Errorf("%s /metrics: %w", name, err)
		}
		body, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("%s /metrics: %w", name, err)
		}
		out[name] = string(body)
	}
	return out, nil
}

func cpuOf(pids map[string]int) (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	for name, pid := range pids {
		d, err := CPUTime(pid)
		if err != nil {
			return nil, err
		}
		out[name] = d
	}
	return out, nil
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// hopFigures are a hop's counters between two scrapes.
type hopFigures struct{ calls, retries, refused float64 }

func (s *ampSide) hop(h ampHop, from, to map[string]string) hopFigures {
	d := func(metric string, match map[string]string) float64 {
		return PromSum(to[h.caller], metric, match) - PromSum(from[h.caller], metric, match)
	}
	return hopFigures{
		calls:   d("curfew_retry_attempts_total", map[string]string{"target": h.target, "method": h.method, "retry": "false"}),
		retries: d("curfew_retry_attempts_total", map[string]string{"target": h.target, "method": h.method, "retry": "true"}),
		// The counter has no method label; each caller reaches each target through one
		// streaming method (and unary ListNodes calls, which are not failed here).
		refused: d("curfew_retry_budget_exhausted_total", map[string]string{"target": h.target}),
	}
}

func printAmpTables(cells []ampCell) {
	if len(cells) == 0 {
		return
	}
	var sb strings.Builder
	model, fail, subs, leaves := ampTree.Calls()
	fmt.Fprintf(&sb, "\nretry amplification: %.0f %% UNAVAILABLE at every model step and fail tool; tree root → %d × %d subagents, %d leaves; a fault-free run makes %d model calls, %d fail tools, %d subagents\n",
		100*ampTree.Rate, ampTree.Fanout, ampTree.Fanout, leaves, model, fail, subs)
	for _, steady := range []bool{true, false} {
		if steady {
			fmt.Fprintf(&sb, "\nsteady state: runs started ≥ %v after the measurement began\n", ampSteady)
		} else {
			fmt.Fprintf(&sb, "\nall measured runs (with the first %v, while the budget's window fills)\n", ampSteady)
		}
		fmt.Fprintf(&sb, "| load | mode | runs | root success | 95 %% CI (Wilson) | leaf calls | leaf attempts/call: mean ± 95 %% | p50 | p99 | max | histogram 1/2/3/4+ | leaf attempts / root run | model attempts / root run (all levels) | run p50 / p99 ms |\n")
		fmt.Fprintf(&sb, "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---|\n")
		for _, c := range cells {
			for _, s := range c.sides {
				runs := s.runs
				if steady {
					runs = c.steady(s)
				}
				st := s.stats(runs)
				lo, hi := Wilson(st.ok, st.runs, 1.96)
				h := st.leafAttempts.Histogram()
				over := 0
				for v, k := range h {
					if v >= 4 {
						over += k
					}
				}
				fmt.Fprintf(&sb, "| %s | %s | %d | %.1f %% | %.1f–%.1f %% | %d | %.3f ± %.3f | %d | %d | %d | %d / %d / %d / %d | %.2f | %.2f | %.0f / %.0f |\n",
					c.load.Name(), s.mode, st.runs, 100*float64(st.ok)/float64(max(st.runs, 1)), 100*lo, 100*hi,
					len(st.leafAttempts), st.leafAttempts.Mean(), st.leafAttempts.MeanCI(1.96),
					st.leafAttempts.Quantile(.5), st.leafAttempts.Quantile(.99), st.leafAttempts.Max(),
					h[1], h[2], h[3], over, st.leafPerRun.Mean(), st.modelPerRun.Mean(),
					msf(st.durs.Quantile(.5)), msf(st.durs.Quantile(.99)))
			}
		}
		fmt.Fprintf(&sb, "\nroot success rate, %s − %s (Newcombe 95 %%):\n", ampModes[0], ampModes[1])
		for _, c := range cells {
			ra, rb := c.sides[0].runs, c.sides[1].runs
			if steady {
				ra, rb = c.steady(c.sides[0]), c.steady(c.sides[1])
			}
			a, b := c.sides[0].stats(ra), c.sides[1].stats(rb)
			d, lo, hi := NewcombeDiff(a.ok, a.runs, b.ok, b.runs)
			fmt.Fprintf(&sb, "- %s: %+.1f points (%+.1f to %+.1f)\n", c.load.Name(), 100*d, 100*lo, 100*hi)
		}
	}
	fmt.Fprintf(&sb, "\nper hop, steady state (from each caller's /metrics; calls = first attempts; refused = retries the budget refused)\n")
	fmt.Fprintf(&sb, "| load | mode | hop | calls | calls/s | retries | retries/call | refused | refused / (retries + refused) |\n")
	fmt.Fprintf(&sb, "|---:|---|---|---:|---:|---:|---:|---:|---:|\n")
	for _, c := range cells {
		for _, s := range c.sides {
			if s.mid == nil {
				continue
			}
			secs := (s.wall - ampSteady).Seconds()
			for _, h := range ampHops {
				f := s.hop(h, s.mid, s.after)
				fmt.Fprintf(&sb, "| %s | %s | %s | %.0f | %.1f | %.0f | %.3f | %.0f | %.1f %% |\n", c.load.Name(), s.mode, h, f.calls, f.calls/secs,
					f.retries, f.retries/max(f.calls, 1), f.refused, 100*f.refused/max(f.retries+f.refused, 1))
			}
		}
	}
	fmt.Fprintf(&sb, "\nall runs: upper-layer re-runs, outcomes and cost\n")
	fmt.Fprintf(&sb, "| load | mode | runs | max retry-ids per leaf | attempts per spawn tool / subagent node (max) | fail tool attempts mean (max) | upper model attempts mean (max) | budget refusals (all hops) | leaf outcomes | run outcomes | wall s | CPU s: orch / tool / sub / model | others' CPU s | load at start → end |\n")
	fmt.Fprintf(&sb, "|---:|---|---:|---:|---|---|---|---:|---|---|---:|---|---:|---|\n")
	for _, c := range cells {
		for _, s := range c.sides {
			st := s.stats(s.runs)
			var refused float64
			for _, h := range ampHops {
				refused += s.hop(h, s.before, s.after).refused
			}
			fmt.Fprintf(&sb, "| %s | %s | %d | %d | %d / %d | %.3f (%d) | %.3f (%d) | %.0f | %s | %s | %.1f | %.1f / %.1f / %.1f / %.1f | %.1f | %s → %s |\n",
				c.load.Name(), s.mode, st.runs, st.leafRetryIDs.Max(), st.spawnAtt.Max(), st.subAttempts.Max(),
				st.failAtt.Mean(), st.failAtt.Max(), st.upper.Mean(), st.upper.Max(), refused,
				counts(st.leafOutcome), counts(st.runOutcome), s.wall.Seconds(),
				s.cpu["orchestrator"].Seconds(), s.cpu["toolrunner"].Seconds(), s.cpu["subagent"].Seconds(), s.cpu["modelproxy"].Seconds(),
				c.othersCPU.Seconds(), c.load0, c.load1)
		}
	}
	fmt.Fprintf(&sb, "\nprobe: root → subagent → subagent → leaf, the leaf fails every attempt (%d runs per mesh, after %v of quiet)\n", ampProbeRuns, ampQuiet)
	fmt.Fprintf(&sb, "| load | mode | leaf attempts per run | retry-ids per leaf (max) | upper model attempts (max) | spawn tool attempts (max) | subagent attempts (max) | run outcomes |\n")
	fmt.Fprintf(&sb, "|---:|---|---|---:|---:|---:|---:|---|\n")
	for _, c := range cells {
		for _, s := range c.sides {
			st := s.stats(s.probe)
			per := make([]string, len(st.leafPerRun))
			for i, v := range st.leafPerRun {
				per[i] = strconv.Itoa(v)
			}
			fmt.Fprintf(&sb, "| %s | %s | %s | %d | %d | %d | %d | %s |\n", c.load.Name(), s.mode, strings.Join(per, ", "),
				st.leafRetryIDs.Max(), st.upper.Max(), st.spawnAtt.Max(), st.subAttempts.Max(), counts(st.runOutcome))
		}
	}
	addReport(sb.String())
}

// counts formats a count map as "a 3, b 1", largest first.
func counts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b string) int {
		if m[a] != m[b] {
			return m[b] - m[a]
		}
		return strings.Compare(a, b)
	})
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}

// writeAmpRaw writes a cell's runs and leaf calls as CSV into CURFEW_BENCH_RAW when set.
func writeAmpRaw(c ampCell) error {
	dir := os.Getenv("CURFEW_BENCH_RAW")
	if dir == "" {
		return nil
	}
	var runs, leaves strings.Builder
	runs.WriteString("mode,run_id,start_ms,ok,code,dur_ms,leaves,leaf_attempts,model_attempts\n")
	leaves.WriteString("mode,run_id,node,attempts,retry_ids,status,error_code\n")
	for _, s := range c.sides {
		for _, r := range s.runs {
			nl, la, ma := 0, 0, 0
			for _, nd := range r.model {
				a := 1 + len(nd.GetEarlierAttempts())
				ma += a
				if NodeDepth(nd.GetId()) < ampTree.Depth {
					continue
				}
				nl++
				la += a
				fmt.Fprintf(&leaves, "%s,%s,%s,%d,%d,%s,%s\n", s.mode, r.id, nd.GetId(), a, retryIDs(nd),
					strings.TrimPrefix(nd.GetStatus().String(), "NODE_STATUS_"), nd.GetErrorCode())
			}
			fmt.Fprintf(&runs, "%s,%s,%.1f,%t,%s,%.1f,%d,%d,%d\n", s.mode, r.id, msf(r.start.Sub(c.t0)), r.ok, r.code, msf(r.dur), nl, la, ma)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("amplify-%s-runs.csv", strings.ReplaceAll(c.load.Name(), "=", ""))), []byte(runs.String()), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, fmt.Sprintf("amplify-%s-leaves.csv", strings.ReplaceAll(c.load.Name(), "=", ""))), []byte(leaves.String()), 0o644)
}

func TestAmpTreePlan(t *testing.T) {
	for _, tr := range []AmpTree{ampTree, {Depth: 0, Rate: 0.3, LeafTokens: 1, TPS: 1000}, {Depth: 3, Fanout: 1, LeafTokens: 1}} {
		p, err := plan.Parse([]byte(tr.Plan()))
		if err != nil {
			t.Fatalf("%+v: %v\n%s", tr, err, tr.Plan())
		}
		// Walk the plan: count model steps, fail tools, spawns.
		var model, fail, subs, leaves int
		var walk func(p *plan.Plan, d int)
		walk = func(p *plan.Plan, d int) {
			for _, s := range p.Steps {
				model++
				if (s.ModelError != nil) != (tr.Rate > 0) || (s.ModelError != nil && s.ModelError.Rate != tr.Rate) {
					t.Errorf("%+v: step %+v: model_error %+v, want rate %v", tr, s, s.ModelError, tr.Rate)
				}
				if s.AnswerTokens > 0 && d == tr.Depth {
					leaves++
				}
				for _, tool := range s.Tools {
					switch tool.Name {
					case plan.ToolFail:
						fail++
					case plan.ToolSpawnSubagent:
						subs++
						var a plan.SpawnArgs
						if err := plan.Args(tool.Args, &a); err != nil {
							t.Fatal(err)
						}
						c, err := plan.Parse(a.Plan)
						if err != nil {
							t.Fatal(err)
						}
						walk(c, d+1)
					}
				}
			}
		}
		walk(p, 0)
		wm, wf, ws, wl := tr.Calls()
		if model != wm || fail != wf || subs != ws || leaves != wl {
			t.Errorf("%+v: plan has %d model steps, %d fail tools, %d subagents, %d leaves; Calls says %d, %d, %d, %d",
				tr, model, fail, subs, leaves, wm, wf, ws, wl)
		}
	}
	if m, f, s, l := ampTree.Calls(); m != 10 || f != 3 || s != 6 || l != 4 {
		t.Errorf("benchmark tree: %d model calls, %d fail tools, %d subagents, %d leaves; want 10, 3, 6, 4", m, f, s, l)
	}
}

func TestNodeDepth(t *testing.T) {
	for id, want := range map[string]int{"root/m0": 0, "root/s0.t1/sub/m1": 1, "root/s0.t1/sub/s0.t0/sub/m0": 2, "root/s0.t2": 0} {
		if got := NodeDepth(id); got != want {
			t.Errorf("NodeDepth(%q) = %d, want %d", id, got, want)
		}
	}
}

func TestWilson(t *testing.T) {
	// Reference values (Wilson score interval, z = 1.96).
	for _, c := range []struct {
		k, n   int
		lo, hi float64
	}{{0, 10, 0, 0.2775}, {10, 10, 0.7225, 1}, {50, 100, 0.4038, 0.5962}, {81, 263, 0.2553, 0.3662}} {
		lo, hi := Wilson(c.k, c.n, 1.96)
		if math.Abs(lo-c.lo) > 5e-4 || math.Abs(hi-c.hi) > 5e-4 {
			t.Errorf("Wilson(%d, %d) = %.4f–%.4f, want %.4f–%.4f", c.k, c.n, lo, hi, c.lo, c.hi)
		}
	}
	// Newcombe's example 1 (Statist. Med. 1998): 56/70 − 48/80, interval 0.0524 to 0.3339.
	d, lo, hi := NewcombeDiff(56, 70, 48, 80)
	if math.Abs(d-0.2) > 1e-9 || math.Abs(lo-0.0524) > 5e-4 || math.Abs(hi-0.3339) > 5e-4 {
		t.Errorf("NewcombeDiff(56, 70, 48, 80) = %.4f (%.4f to %.4f), want 0.2000 (0.0524 to 0.3339)", d, lo, hi)
	}
}

func TestInts(t *testing.T) {
	s := Ints{1, 1, 1, 2, 3}
	if s.Mean() != 1.6 || s.Quantile(.5) != 1 || s.Quantile(.99) != 3 || s.Max() != 3 {
		t.Errorf("mean %v p50 %d p99 %d max %d", s.Mean(), s.Quantile(.5), s.Quantile(.99), s.Max())
	}
	if h := s.Histogram(); h[1] != 3 || h[2] != 1 || h[3] != 1 {
		t.Errorf("histogram %v", h)
	}
}

func TestPromSum(t *testing.T) {
	text := `# HELP curfew_retry_attempts_total x
# TYPE curfew_retry_attempts_total counter
curfew_retry_attempts_total{code="OK",method="/a",retry="false",target="modelproxy"} 10
curfew_retry_attempts_total{code="Unavailable",method="/a",retry="true",target="modelproxy"} 3
curfew_retry_attempts_total{code="OK",method="/b",retry="true",target="toolrunner"} 2
curfew_retry_budget_exhausted_total{target="modelproxy"} 4
go_goroutines 7
`
	for _, c := range []struct {
		name  string
		match map[string]string
		want  float64
	}{
		{"curfew_retry_attempts_total", nil, 15},
		{"curfew_retry_attempts_total", map[string]string{"retry": "true"}, 5},
		{"curfew_retry_attempts_total", map[string]string{"retry": "true", "target": "modelproxy"}, 3},
		{"curfew_retry_budget_exhausted_total", nil, 4},
		{"go_goroutines", nil, 7},
		{"missing", nil, 0},
	} {
		if got := PromSum(text, c.name, c.match); got != c.want {
			t.Errorf("PromSum(%s, %v) = %v, want %v", c.name, c.match, got, c.want)
		}
	}
}

func TestAmpProbePlan(t *testing.T) {
	p, err := plan.Parse([]byte(ampProbe.Plan()))
	if err != nil {
		t.Fatal(err)
	}
	for d := 0; ; d++ {
		if d == ampProbe.Depth {
			if len(p.Steps) != 1 || p.Steps[0].ModelError == nil || p.Steps[0].ModelError.Attempts != 100 {
				t.Fatalf("leaf steps %+v: want one step failing every attempt", p.Steps)
			}
			return
		}
		if len(p.Steps) != 2 || len(p.Steps[0].Tools) != 1 || p.Steps[0].ModelError != nil || p.Steps[1].ModelError != nil {
			t.Fatalf("level %d steps %+v: want one fault-free spawn step and an answer", d, p.Steps)
		}
		var a plan.SpawnArgs
		if err := plan.Args(p.Steps[0].Tools[0].Args, &a); err != nil {
			t.Fatal(err)
		}
		if p, err = plan.Parse(a.Plan); err != nil {
			t.Fatal(err)
		}
	}
}

func TestParseAmpLoads(t *testing.T) {
	got, err := parseAmpLoads("rate=4, conc=2,conc=16,rate=0.5")
	if err != nil {
		t.Fatal(err)
	}
	want := []ampLoad{{Rate: 4}, {Conc: 2}, {Conc: 16}, {Rate: 0.5}}
	if !slices.Equal(got, want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	if got[0].Name() != "rate=4" || got[2].Name() != "conc=16" || got[3].Name() != "rate=0.5" {
		t.Errorf("names %s %s %s", got[0].Name(), got[2].Name(), got[3].Name())
	}
	for _, bad := range []string{"", "conc=0", "conc=1.5", "rate=-1", "speed=3", "conc"} {
		if _, err := parseAmpLoads(bad); err == nil {
			t.Errorf("parseAmpLoads(%q): no error", bad)
		}
	}
}
