package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Settings of the cancel-propagation benchmark.
const (
	// leafTokens at leafTPS keep every leaf decoding for 100 s, far longer than an
	// iteration, so each leaf is cancelled mid-decode.
	leafTokens = 4000
	leafTPS    = 40
	// runDeadline is the Run call's deadline; it never fires during an iteration.
	runDeadline = 2 * time.Minute
	// steadyPause separates "every leaf has emitted a token" from the cancel, so the
	// cancel lands on a tree in steady state (decoders waiting for their next token).
	steadyPause = 100 * time.Millisecond
	// quietPause is how long the client stays idle after its cancel before it asks for
	// the results, so that its own polling cannot slow the teardown it measures.
	quietPause = 300 * time.Millisecond
	// cancelFanout is toolrunner's per-run subagent limit for this benchmark: the 64-leaf
	// trees hold 72 and 84 subagents, more than the default of 32.
	cancelFanout = 128
)

// cancelSample is one iteration's figures.
type cancelSample struct {
	clientToLast  time.Duration // client's cancel → last leaf decoder ended (modelproxy's clock)
	clientToFirst time.Duration // client's cancel → first leaf decoder ended
	orchToLast    time.Duration // orchestrator's recorded cancel instant → last leaf ended
	clientToOrch  time.Duration // client's cancel → orchestrator's recorded cancel instant
	orphanTokens  int64         // tokens decoded after the orchestrator's cancel instant
	// teardownCPU is the CPU time each service used from the cancel to quietPause after
	// it (index as serviceNames); with the decoders stopped, all of it is teardown work.
	teardownCPU [4]time.Duration
	// gcs is how many garbage collections the four services ran, together, between the
	// steady pause and quietPause after the cancel.
	gcs int
	// othersCPU is the CPU time every other process of the machine used in the same
	// window (machine busy time from /proc/stat minus the services'), 10 ms resolution:
	// how much the neighbours competed for the two cores.
	othersCPU time.Duration
	// t0, orchCancel and lastEnd are the instants themselves (wall clock), for matching
	// samples with traces taken outside the benchmark.
	t0, orchCancel, lastEnd time.Time
}

// procs are the service processes of a mesh, indexed as serviceNames.
type procs struct {
	pids   [4]int
	admins [4]string
}

type cancelResult struct {
	shape   Shape
	samples []cancelSample
}

// cancelResults collects every cell's samples, for the table printed at the end.
var cancelResults []cancelResult

// BenchmarkCancelPropagation measures, across the real processes, the time from a client
// cancelling its Run call (a disconnect: RST_STREAM) to the last leaf decoder in
// modelproxy stopping, for each Shape. Each iteration:
//
//  1. calls OrchestratorService.Run with the shape's plan (leaves decode 4000 tokens at
//     40 tokens/s) and a 2-minute deadline;
//  2. reads the Run stream until every leaf's model node has reported tokens > 0 (so
//     every decoder is running), then waits steadyPause;
//  3. notes the instant t0 and cancels the call's context;
//  4. after quietPause, polls GetRun until the run ended and reads Run.cancelled_at
//     (the orchestrator's cancel instant) and tokens_after_cancel;
//  5. reads modelproxy's own node records (NodeReportService.ListNodes with a settle
//     timeout) and takes the leaves' ended_at, written when each decoder's loop returned.
//
// Metrics: p50/p90/p99/max of max(ended_at) − t0 in ms, over the iterations
// (-benchtime=<n>x; nearest-rank percentiles, so p99 is the maximum below 100 samples),
// and the p99 of max(ended_at) − cancelled_at (the part inside the mesh).
func BenchmarkCancelPropagation(b *testing.B) {
	orch, mp, ps := startCancelMesh(b)
	cancelResults = nil
	for _, s := range Shapes {
		b.Run(s.Name(), func(b *testing.B) {
			task := TreePlan(s, leafTokens, leafTPS)
			ctx := context.Background()
			if _, err := cancelOnce(ctx, orch, mp, ps, s, task); err != nil { // warm-up, not recorded
				b.Fatal(err)
			}
			res := cancelResult{shape: s}
			for b.Loop() {
				smp, err := cancelOnce(ctx, orch, mp, ps, s, task)
				if err != nil {
					b.Fatal(err)
				}
				res.samples = append(res.samples, smp)
			}
			var last, orch Dist
			var orphans int64
			for _, x := range res.samples {
				last = append(last, x.clientToLast)
				orch = append(orch, x.orchToLast)
				orphans = max(orphans, x.orphanTokens)
			}
			b.ReportMetric(msf(last.Quantile(.5)), "p50-ms")
			b.ReportMetric(msf(last.Quantile(.9)), "p90-ms")
			b.ReportMetric(msf(last.Quantile(.99)), "p99-ms")
			b.ReportMetric(msf(last.Max()), "max-ms")
			b.ReportMetric(msf(orch.Quantile(.99)), "mesh-p99-ms")
			b.ReportMetric(float64(orphans), "max-orphan-tokens")
			cancelResults = append(cancelResults, res)
			if err := writeRaw(res); err != nil {
				b.Log("raw samples: ", err)
			}
		})
	}
	printCancelTable(cancelResults)
}

func msf(d time.Duration) float64 { return float64(d) / 1e6 }

// cancelOnce runs one iteration (see BenchmarkCancelPropagation).
func cancelOnce(ctx context.Context, orch orchestratorv1.OrchestratorServiceClient, mp meshv1.NodeReportServiceClient, ps procs, s Shape, task string) (cancelSample, error) {
	var smp cancelSample
	rctx, cancel := context.WithTimeout(ctx, runDeadline)
	defer cancel()
	st, err := orch.Run(rctx, &orchestratorv1.RunRequest{Task: task})
	if err != nil {
		return smp, err
	}
	ev, err := st.Recv()
	if err != nil {
		return smp, fmt.Errorf("first event: %w", err)
	}
	run := ev.GetStarted().GetRunId()
	if run == "" {
		return smp, fmt.Errorf("first event is not started: %v", ev)
	}
	// Every leaf decoding: a model node that reported tokens. Spawning levels decode 0
	// tokens, so exactly the leaves qualify.
	decoding := map[string]bool{}
	timeout := time.AfterFunc(30*time.Second, cancel)
	for len(decoding) < s.Leaves {
		ev, err := st.Recv()
		if err != nil {
			timeout.Stop()
			return smp, fmt.Errorf("run %s: %d of %d leaves decoding when the stream ended: %w", run, len(decoding), s.Leaves, err)
		}
		if n := ev.GetNode(); n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL && n.GetTokens() > 0 && n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
			decoding[n.GetId()] = true
		}
	}
	timeout.Stop()
	drained := make(chan struct{})
	go func() { // keep reading, as a live client would, until the call ends
		defer close(drained)
		for {
			if _, err := st.Recv(); err != nil {
				return
			}
		}
	}()
	gc0 := gcCount(ps)
	time.Sleep(steadyPause)

	cpu0, err := cpuTimes(ps.pids)
	if err != nil {
		return smp, err
	}
	busy0, err := MachineBusy()
	if err != nil {
		return smp, err
	}
	t0 := time.Now()
	cancel() // the client disconnects
	<-drained
	time.Sleep(quietPause)
	cpu1, err := cpuTimes(ps.pids)
	if err != nil {
		return smp, err
	}
	busy1, err := MachineBusy()
	if err != nil {
		return smp, err
	}
	smp.othersCPU = busy1 - busy0
	smp.gcs = gcCount(ps) - gc0
	for i := range cpu1 {
		smp.teardownCPU[i] = cpu1[i] - cpu0[i]
		smp.othersCPU -= smp.teardownCPU[i]
	}

	r, err := waitEnded(ctx, orch, run, 20*time.Second)
	if err != nil {
		return smp, err
	}
	if r.GetCancelledAt() == nil {
		return smp, fmt.Errorf("run %s ended without a cancel instant: %v %v", run, r.GetStatus(), r.GetErrorMessage())
	}
	if r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		return smp, fmt.Errorf("run %s ended with cause %v, want client_disconnect", run, r.GetCause())
	}
	cancelledAt := r.GetCancelledAt().AsTime()
	lctx, lcancel := context.WithTimeout(ctx, 15*time.Second)
	defer lcancel()
	resp, err := mp.ListNodes(lctx, &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(10 * time.Second),
		CancelAt: timestamppb.New(cancelledAt)})
	if err != nil {
		return smp, fmt.Errorf("modelproxy ListNodes: %w", err)
	}
	if !resp.GetSettled() {
		return smp, fmt.Errorf("run %s: modelproxy's decoders had not all stopped 10 s after the cancel", run)
	}
	var first, last time.Time
	leaves := 0
	for _, n := range resp.GetNodes() {
		if !decoding[n.GetId()] {
			continue
		}
		leaves++
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetEndedAt() == nil {
			return smp, fmt.Errorf("run %s: leaf %s ended %v, want cancelled", run, n.GetId(), n.GetStatus())
		}
		e := n.GetEndedAt().AsTime()
		if first.IsZero() || e.Before(first) {
			first = e
		}
		if e.After(last) {
			last = e
		}
		smp.orphanTokens += n.GetTokensAfterCancel()
	}
	if leaves != s.Leaves {
		return smp, fmt.Errorf("run %s: modelproxy reports %d of %d leaves", run, leaves, s.Leaves)
	}
	// Wall clocks of one machine: t0 from this process, the rest from the services.
	wall := func(t time.Time) int64 { return t.UnixNano() }
	smp.clientToLast = time.Duration(wall(last) - wall(t0))
	smp.clientToFirst = time.Duration(wall(first) - wall(t0))
	smp.orchToLast = time.Duration(wall(last) - wall(cancelledAt))
	smp.clientToOrch = time.Duration(wall(cancelledAt) - wall(t0))
	smp.t0, smp.orchCancel, smp.lastEnd = t0, cancelledAt, last
	return smp, nil
}

func cpuTimes(pids [4]int) ([4]time.Duration, error) {
	var out [4]time.Duration
	for i, pid := range pids {
		d, err := CPUTime(pid)
		if err != nil {
			return out, err
		}
		out[i] = d
	}
	return out, nil
}

// gcCount sums go_gc_duration_seconds_count over the services (-1 for one that cannot
// be read).
func gcCount(ps procs) int {
	n := 0
	for _, a := range ps.admins {
		text, err := scrape(a)
		if err != nil {
			return -1
		}
		v, ok := PromValue(text, "go_gc_duration_seconds_count")
		if !ok {
			return -1
		}
		n += int(v)
	}
	return n
}

// waitEnded polls GetRun until the run is no longer running.
func waitEnded(ctx context.Context, orch orchestratorv1.OrchestratorServiceClient, run string, within time.Duration) (*orchestratorv1.Run, error) {
	end := time.Now().Add(within)
	for {
		gctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		resp, err := orch.GetRun(gctx, &orchestratorv1.GetRunRequest{RunId: run})
		cancel()
		if err != nil {
			return nil, fmt.Errorf("GetRun %s: %w", run, err)
		}
		if r := resp.GetRun(); r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return r, nil
		}
		if time.Now().After(end) {
			return nil, errors.New("run " + run + " still running after " + within.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func printCancelTable(rs []cancelResult) {
	if len(rs) == 0 {
		return
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\ncancel propagation: client cancel → last leaf decoder stopped (ms)\n")
	fmt.Fprintf(&sb, "| leaves | depth | tree | n | p50 | p90 | p99 | max | first leaf p50 | client→orch p50 | orch→last p50 | orch→last p99 | orphan tokens (max) | teardown CPU ms p50: orch / tool / sub / model | others' CPU ms p50 |\n")
	fmt.Fprintf(&sb, "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n")
	for _, r := range rs {
		var last, first, orch, c2o Dist
		var orphans int64
		var cpu [4]Dist
		var others Dist
		for _, x := range r.samples {
			others = append(others, x.othersCPU)
			for i := range cpu {
				cpu[i] = append(cpu[i], x.teardownCPU[i])
			}
			last = append(last, x.clientToLast)
			first = append(first, x.clientToFirst)
			orch = append(orch, x.orchToLast)
			c2o = append(c2o, x.clientToOrch)
			orphans = max(orphans, x.orphanTokens)
		}
		fmt.Fprintf(&sb, "| %d | %d | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %d | %s / %s / %s / %s | %.0f |\n",
			r.shape.Leaves, r.shape.Depth, r.shape.Desc(), len(r.samples),
			ms(last.Quantile(.5)), ms(last.Quantile(.9)), ms(last.Quantile(.99)), ms(last.Max()),
			ms(first.Quantile(.5)), ms(c2o.Quantile(.5)), ms(orch.Quantile(.5)), ms(orch.Quantile(.99)), orphans,
			ms1(cpu[0].Quantile(.5)), ms1(cpu[1].Quantile(.5)), ms1(cpu[2].Quantile(.5)), ms1(cpu[3].Quantile(.5)),
			msf(others.Quantile(.5)))
	}
	addReport(sb.String())
}

// writeRaw writes a cell's samples as CSV into CURFEW_BENCH_RAW (a directory) when set.
func writeRaw(r cancelResult) error {
	dir := os.Getenv("CURFEW_BENCH_RAW")
	if dir == "" {
		return nil
	}
	var sb strings.Builder
	sb.WriteString("client_to_last_ms,client_to_first_ms,orch_to_last_ms,client_to_orch_ms,orphan_tokens,gcs,others_cpu_ms")
	for _, n := range serviceNames {
		sb.WriteString(",cpu_" + n + "_ms")
	}
	sb.WriteString(",t0_unix_ns,orch_cancel_unix_ns,last_end_unix_ns\n")
	for _, x := range r.samples {
		fmt.Fprintf(&sb, "%.3f,%.3f,%.3f,%.3f,%d,%d,%.0f", msf(x.clientToLast), msf(x.clientToFirst), msf(x.orchToLast), msf(x.clientToOrch), x.orphanTokens, x.gcs, msf(x.othersCPU))
		for _, c := range x.teardownCPU {
			fmt.Fprintf(&sb, ",%.3f", msf(c))
		}
		fmt.Fprintf(&sb, ",%d,%d,%d", x.t0.UnixNano(), x.orchCancel.UnixNano(), x.lastEnd.UnixNano())
		sb.WriteString("\n")
	}
	name := fmt.Sprintf("cancel-leaves%d-depth%d.csv", r.shape.Leaves, r.shape.Depth)
	return os.WriteFile(filepath.Join(dir, name), []byte(sb.String()), 0o644)
}

// startCancelMesh starts the mesh of the 64-leaf cancel benchmarks (the subagent fan-out
// raised to cancelFanout; stopped when b ends) and returns its orchestrator, modelproxy's node reports and the
// processes to sample.
func startCancelMesh(b *testing.B) (orchestratorv1.OrchestratorServiceClient, meshv1.NodeReportServiceClient, procs) {
	b.Helper()
	m := startMesh(b, fmt.Sprintf("CURFEW_MAX_SUBAGENT_FANOUT=%d", cancelFanout))
	orch, err := m.Orchestrator()
	if err != nil {
		b.Fatal(err)
	}
	mp, err := m.Report("modelproxy")
	if err != nil {
		b.Fatal(err)
	}
	var ps procs
	for i, name := range serviceNames {
		ps.pids[i] = m.Endpoints.Services[name].PID
		ps.admins[i] = m.Endpoints.Services[name].AdminAddr
	}
	return orch, mp, ps
}
