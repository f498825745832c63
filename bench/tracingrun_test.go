package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// Settings of BenchmarkTracingRun; CURFEW_BENCH_TRACE_RATIO overrides the sampled share
// of the ratio setup, in per mille, and CURFEW_BENCH_TRACE_CANCELS the cancel iterations.
const (
	tracingDemoRuns   = 8  // demo runs in flight per block (each takes about 13 s)
	tracingRatioMille = 10 // 1 %: the parent-based ratio sampler's share of runs
	tracingCancels    = 10 // 64-leaf cancel iterations per mesh per round
)

// tracingMesh is one of BenchmarkTracingRun's meshes.
type tracingMesh struct {
	name string
	orch orchestratorv1.OrchestratorServiceClient
	mp   meshv1.NodeReportServiceClient
	ps   procs
	demo []time.Duration // CPU of the four processes per demo block
	runs int             // demo runs over those blocks
	leaf []time.Duration // CPU of the four processes per 64-leaf cancel iteration
	lat  Dist            // the cancel's client → last leaf
}

// BenchmarkTracingRun measures what tracing costs a real run rather than a health call:
// three meshes under `curfew up`, side by side, alternating, with the OpenTelemetry
// Collector of CURFEW_OTELCOL as the receiver (skipped without it):
//
//   - off: no OTEL_* variable, as a mesh runs by default;
//   - on: every span exported over OTLP/gRPC to the collector (OTEL_EXPORTER_OTLP_ENDPOINT,
//     the default sampler parentbased_always_on: 100 % of runs);
//   - ratio: the same with OTEL_TRACES_SAMPLER=parentbased_traceidratio and
//     OTEL_TRACES_SAMPLER_ARG=0.01, the setting docs/tracing.md gives for high volume
//     (the orchestrator's root span decides, every hop below follows its parent).
//
// Two workloads: blocks of tracingDemoRuns concurrent runs of examples/plans/demo.json
// (a model step, sleep, deploy and a nested subagent, about 13 s), and iterations of
// BenchmarkCancelPropagation on the 64-leaf tree of depth 3. For both
// the CPU of the four service processes is summed over the block or iteration (the
// collector's own CPU is not counted: it is the receiver, not curfew). Goal (issue 26):
// on ≤ 1.05 × off in CPU, and the cancel p99 unchanged within the run-to-run spread.
// Run it with -benchtime=<rounds>x; each round makes one demo block and tracingCancels
// cancel iterations on every mesh, the meshes taking turns.
func BenchmarkTracingRun(b *testing.B) {
	bin := os.Getenv("CURFEW_OTELCOL")
	if bin == "" {
		b.Skip("CURFEW_OTELCOL is not set (scripts/otelcol.sh builds the collector and prints its path)")
	}
	addr := startBenchCollector(b, bin)
	ratio := float64(envInt(b, "CURFEW_BENCH_TRACE_RATIO", tracingRatioMille)) / 1000
	cancels := envInt(b, "CURFEW_BENCH_TRACE_CANCELS", tracingCancels)
	fanout := fmt.Sprintf("CURFEW_MAX_SUBAGENT_FANOUT=%d", cancelFanout)
	otlp := []string{fanout, "OTEL_EXPORTER_OTLP_ENDPOINT=http://" + addr, "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"}
	setups := []struct {
		name string
		env  []string
	}{
		{"off", []string{fanout}},
		{"on", otlp},
		{"ratio", append(append([]string{}, otlp...), "OTEL_TRACES_SAMPLER=parentbased_traceidratio", fmt.Sprintf("OTEL_TRACES_SAMPLER_ARG=%g", ratio))},
	}
	meshes := make([]*tracingMesh, len(setups))
	for i, s := range setups {
		m := startMeshWith(b, meshproc.Options{Env: s.env})
		tm := &tracingMesh{name: s.name}
		var err error
		if tm.orch, err = m.Orchestrator(); err != nil {
			b.Fatal(err)
		}
		if tm.mp, err = m.Report("modelproxy"); err != nil {
			b.Fatal(err)
		}
		for j, name := range serviceNames {
			tm.ps.pids[j] = m.Endpoints.Services[name].PID
			tm.ps.admins[j] = m.Endpoints.Services[name].AdminAddr
		}
		meshes[i] = tm
	}
	repo, err := meshproc.Repo()
	if err != nil {
		b.Fatal(err)
	}
	demo, err := os.ReadFile(filepath.Join(repo, "examples", "plans", "demo.json"))
	if err != nil {
		b.Fatal(err)
	}
	var leafShape Shape
	for _, s := range Shapes {
		if s.Leaves == 64 && s.Depth == 3 {
			leafShape = s
		}
	}
	tree := TreePlan(leafShape, leafTokens, leafTPS)
	ctx := context.Background()
	for _, tm := range meshes { // warm-up: connections, and the collector's first batches
		if _, err := cancelOnce(ctx, tm.orch, tm.mp, tm.ps, leafShape, tree); err != nil {
			b.Fatal(err)
		}
	}
	round := 0
	for b.Loop() {
		for i := range meshes {
			tm := meshes[(i+round)%len(meshes)]
			cpu, err := measureCPU(tm.ps, func() error {
				var wg sync.WaitGroup
				errs := make(chan error, tracingDemoRuns)
				for range tracingDemoRuns {
					wg.Go(func() {
						errs <- meshRunWithin(ctx, tm.orch, string(demo), orchestratorv1.RunEvents_RUN_EVENTS_ALL, time.Minute)
					})
				}
				wg.Wait()
				close(errs)
				for err := range errs {
					if err != nil {
						return err
					}
				}
				time.Sleep(throughputSettle)
				return nil
			})
			if err != nil {
				b.Fatalf("%s: demo runs: %v", tm.name, err)
			}
			tm.demo = append(tm.demo, cpu)
			tm.runs += tracingDemoRuns
		}
		for k := range cancels * len(meshes) {
			tm := meshes[(k+round)%len(meshes)]
			var smp cancelSample
			cpu, err := measureCPU(tm.ps, func() error {
				var err error
				smp, err = cancelOnce(ctx, tm.orch, tm.mp, tm.ps, leafShape, tree)
				return err
			})
			if err != nil {
				b.Fatalf("%s: 64-leaf cancel: %v", tm.name, err)
			}
			tm.leaf = append(tm.leaf, cpu)
			tm.lat = append(tm.lat, smp.clientToLast)
		}
		round++
	}
	off := meshes[0]
	for _, tm := range meshes {
		b.ReportMetric(msf(sumDur(tm.demo))/float64(tm.runs), "cpu-per-demo-run-"+tm.name+"-ms")
		b.ReportMetric(msf(sumDur(tm.leaf))/float64(len(tm.leaf)), "cpu-per-64leaf-"+tm.name+"-ms")
		b.ReportMetric(msf(tm.lat.Quantile(.99)), "cancel-p99-"+tm.name+"-ms")
		if tm != off {
			b.ReportMetric(float64(sumDur(tm.demo))/float64(sumDur(off.demo)), "demo-cpu-"+tm.name+"/off-x")
			b.ReportMetric(float64(sumDur(tm.leaf))/float64(sumDur(off.leaf)), "64leaf-cpu-"+tm.name+"/off-x")
		}
	}
	printTracingRunTable(meshes, ratio)
}

// measureCPU returns the CPU the processes ps used while f ran.
func measureCPU(ps procs, f func() error) (time.Duration, error) {
	c0, err := cpuTimes(ps.pids)
	if err != nil {
		return 0, err
	}
	if err := f(); err != nil {
		return 0, err
	}
	c1, err := cpuTimes(ps.pids)
	if err != nil {
		return 0, err
	}
	var d time.Duration
	for i := range c1 {
		d += c1[i] - c0[i]
	}
	return d, nil
}

func sumDur(ds []time.Duration) time.Duration {
	var s time.Duration
	for _, d := range ds {
		s += d
	}
	return s
}

func printTracingRunTable(meshes []*tracingMesh, ratio float64) {
	var sb strings.Builder
	off := meshes[0]
	fmt.Fprintf(&sb, "\ntracing on real runs: CPU of the four service processes, off / on (100 %%, OTLP/gRPC to the collector) / ratio (parentbased_traceidratio %g), alternating; load at end %s\n", ratio, loadAvg())
	fmt.Fprintf(&sb, "| setup | demo runs | CPU per demo run ms | vs off | 64-leaf iterations | CPU per 64-leaf iteration ms | vs off | cancel p50 ms | cancel p99 ms | cancel max ms |\n")
	fmt.Fprintf(&sb, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, tm := range meshes {
		fmt.Fprintf(&sb, "| %s | %d | %.1f | %.3f | %d | %.1f | %.3f | %s | %s | %s |\n", tm.name, tm.runs,
			msf(sumDur(tm.demo))/float64(tm.runs), float64(sumDur(tm.demo))/float64(sumDur(off.demo)),
			len(tm.leaf), msf(sumDur(tm.leaf))/float64(len(tm.leaf)), float64(sumDur(tm.leaf))/float64(sumDur(off.leaf)),
			ms(tm.lat.Quantile(.5)), ms(tm.lat.Quantile(.99)), ms(tm.lat.Max()))
	}
	addReport(sb.String())
}
