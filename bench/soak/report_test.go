package soak

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

func TestPercentiles(t *testing.T) {
	var ds []time.Duration
	for i := 1; i <= 100; i++ {
		ds = append(ds, time.Duration(i)*time.Millisecond)
	}
	p := percentiles(ds)
	if p.N != 100 || p.P50 != 50 || p.P90 != 90 || p.P99 != 99 || p.Max != 100 {
		t.Fatalf("percentiles = %+v", p)
	}
	if (percentiles(nil) != Percentiles{}) {
		t.Fatal("percentiles of nothing are not zero")
	}
}

// The report counts outcomes by code, names a lost run, measures the cancel to the last
// decoder and the deadline overshoot from the nodes, counts tokens after a cancel per
// decoder, and its checks fail on a lost run, on a decoder with 2 tokens after its
// cancel and on goroutines left over.
func TestReportOutcomesAndChecks(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	model := func(end time.Duration, after int64) *meshv1.Node {
		return &meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_MODEL, EndedAt: timestamppb.New(t0.Add(end)), TokensAfterCancel: after}
	}
	run := func(st orchestratorv1.RunStatus, code string, nodes ...*meshv1.Node) *orchestratorv1.Run {
		return &orchestratorv1.Run{Status: st, ErrorCode: code, Nodes: nodes, Deadline: timestamppb.New(t0.Add(2 * time.Second))}
	}
	outs := []outcome{
		{kind: Tools, id: "a", started: t0, ended: t0.Add(time.Second), final: run(orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED, "", model(time.Second, 0))},
		{kind: Failing, id: "b", started: t0, ended: t0.Add(time.Second), final: run(orchestratorv1.RunStatus_RUN_STATUS_FAILED, "INVALID_ARGUMENT")},
		{kind: Cancelled, id: "c", started: t0, ended: t0.Add(2 * time.Second), cancelAt: t0.Add(time.Second),
			final: run(orchestratorv1.RunStatus_RUN_STATUS_CANCELLED, "", model(1003*time.Millisecond, 1), model(1007*time.Millisecond, 2))},
		{kind: Deadline, id: "d", started: t0, ended: t0.Add(2 * time.Second),
			final: run(orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED, "", model(2004*time.Millisecond, 0))},
		{kind: Tools, id: "e", started: t0}, // never seen to end
		{kind: Tools, startErr: codes.ResourceExhausted, started: t0, ended: t0},
	}
	base := []Sample{{Process: "orchestrator", Up: true, Goroutines: 50}}
	after := []Sample{{Process: "orchestrator", Up: true, Goroutines: 50 + GoroutineSlack + 1}}
	r := newReport(Config{Concurrency: 4, Duration: 10 * time.Second, Mix: DefaultMix()}, t0, t0.Add(3*time.Second), outs, nil, base, after)
	r.Effects = &Effects{Calls: 3, Duplicates: 1}
	r.GoroutineSlack = GoroutineSlack
	r.check()

	if r.Runs != 5 || r.Refused["ResourceExhausted"] != 1 || r.Outcomes["FAILED/INVALID_ARGUMENT"] != 1 || r.Outcomes["LOST"] != 1 ||
		len(r.Lost) != 1 || r.Lost[0] != "e" {
		t.Fatalf("runs %d, refused %v, outcomes %v, lost %v", r.Runs, r.Refused, r.Outcomes, r.Lost)
	}
	if r.CancelLatency.N != 1 || r.CancelLatency.Max != 7 {
		t.Fatalf("cancel latency %+v, want one of 7 ms (to the last decoder)", r.CancelLatency)
	}
	if r.DeadlineOvershoot.N != 1 || r.DeadlineOvershoot.Max != 4 {
		t.Fatalf("deadline overshoot %+v, want one of 4 ms", r.DeadlineOvershoot)
	}
	if r.OrphanTokens != 3 || r.MaxOrphanPerDecoder != 2 || r.DecodersOverOneOrphan != 1 {
		t.Fatalf("orphans %d, max %d, over one %d; want 3, 2, 1", r.OrphanTokens, r.MaxOrphanPerDecoder, r.DecodersOverOneOrphan)
	}
	failed := map[string]bool{}
	for _, c := range r.Checks {
		if !c.OK {
			failed[strings.SplitN(c.Name, ":", 2)[0]] = true
		}
	}
	for _, want := range []string{"no run lost", "at most one token after a cancel per decoder", "no duplicate side effect", "goroutines back to baseline"} {
		if !failed[want] {
			t.Errorf("check %q held; want it failed (checks %+v)", want, r.Checks)
		}
	}
	if r.OK() {
		t.Fatal("OK with failed checks")
	}
	// With a bound of 2 (--max-tokens-after-cancel), the decoder at 2 passes.
	loose := newReport(Config{Concurrency: 4, Duration: 10 * time.Second, Mix: DefaultMix()}, t0, t0.Add(3*time.Second), outs, nil, base, after)
	loose.TokensAfterCancel = 2
	loose.check()
	held := false
	for _, c := range loose.Checks {
		held = held || (c.Name == "at most 2 tokens after a cancel per decoder" && c.OK)
	}
	if !held {
		t.Errorf("with a bound of 2, the tokens check did not hold for a decoder at 2: %+v", loose.Checks)
	}
	dir := t.TempDir()
	if err := r.WriteJSON(filepath.Join(dir, "report.json")); err != nil {
		t.Fatal(err)
	}
	paths, err := r.Plots(dir)
	if err != nil || len(paths) != 5 {
		t.Fatalf("plots %v, %v; want 5", paths, err)
	}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil || len(b) < 8 || string(b[1:4]) != "PNG" {
			t.Fatalf("%s is not a PNG: %v", p, err)
		}
	}
	if s := r.Summary(); !strings.Contains(s, "FAIL no run lost") || !strings.Contains(s, "LOST 1") {
		t.Fatalf("summary:\n%s", s)
	}
}

// A logical call's effect under two idempotency keys is a duplicate; retries under one
// key are not.
func TestEffectsFromRecord(t *testing.T) {
	path := filepath.Join(t.TempDir(), "calls.jsonl")
	lines := []string{
		`{"tool":"effect","meta":{"timeout_ms":5,"run_id":"r1","node_id":"t0","idempotency_key":"k1"}}`,
		`{"tool":"effect","meta":{"timeout_ms":5,"run_id":"r1","node_id":"t0","idempotency_key":"k1"}}`,
		`{"tool":"effect","meta":{"timeout_ms":5,"run_id":"r2","node_id":"t0","idempotency_key":"k2"}}`,
		`{"tool":"effect","meta":{"timeout_ms":5,"run_id":"r2","node_id":"t0","idempotency_key":"k3"}}`,
		`{"tool":"echo","meta":{"timeout_ms":5,"run_id":"r3","node_id":"t0"}}`,
	}
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	e, err := EffectsFromRecord(path)
	if err != nil || e.Calls != 2 || e.Duplicates != 1 {
		t.Fatalf("effects = %+v, %v; want 2 calls, 1 duplicate", e, err)
	}
}

func TestPlateau(t *testing.T) {
	mib := float64(1 << 20)
	first := &Report{After: []Sample{{Process: "a", Collected: true, HeapInuse: 100 * mib}, {Process: "b", Collected: true, HeapInuse: 100 * mib},
		{Process: "c", Collected: true, HeapInuse: 8 * mib}, {Process: "d", HeapInuse: 8 * mib}}}
	later := &Report{After: []Sample{{Process: "a", Collected: true, HeapInuse: 109 * mib}, {Process: "b", Collected: true, HeapInuse: 111 * mib},
		{Process: "c", Collected: true, HeapInuse: 11 * mib}, {Process: "d", Collected: true, HeapInuse: 8 * mib}}}
	got := map[string]bool{}
	for _, c := range Plateau(first, later) {
		got[strings.TrimPrefix(c.Name, "heap plateau: ")] = c.OK
	}
	want := map[string]bool{"a": true, "b": false, "c": true, "d": false}
	for p, ok := range want {
		if got[p] != ok {
			t.Errorf("%s: plateau %v, want %v (all: %v)", p, got[p], ok, got)
		}
	}
}
