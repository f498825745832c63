package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// The retry tests read counters on the services' /metrics and time the gaps between
// attempts, so none of them calls t.Parallel: they run one at a time, before the parallel
// tests of the package are released, and every counter delta they read is their own.
// The budget test starts a mesh of its own.

// Retry policy defaults (mesh/retry): full-jitter backoff, base 25 ms, cap 250 ms.
const (
	backoffBase = 25 * time.Millisecond
	backoffCap  = 250 * time.Millisecond
	// schedMargin is what a gap between attempts may add to the slept delay on a loaded
	// 2-core machine: the failure's trip back to the caller, the new stream, the server's
	// admission. It is milliseconds when idle.
	schedMargin = 200 * time.Millisecond
	// pushbackMargin bounds how much later than a 500 ms pushback the retry may start.
	pushbackMargin = 400 * time.Millisecond
)

var (
	executeMethod  = toolrunnerv1.ToolRunnerService_Execute_FullMethodName
	generateMethod = modelproxyv1.ModelProxyService_Generate_FullMethodName
)

// backoffCeiling is the full-jitter ceiling of the wait before attempt n (n ≥ 2).
func backoffCeiling(n int) time.Duration {
	return min(backoffCap, backoffBase<<(n-2))
}

// fastPlan is a plan whose one tool step calls tool (a JSON object) after a one-token
// think at 1000 tokens/s, then answers with one token.
func fastPlan(tool string) string {
	return `{"tokens_per_second": 1000, "steps": [{"think_tokens": 1, "tools": [` + tool + `]}, {"answer_tokens": 1}]}`
}

// attempt is one attempt of a node as its executor recorded it.
type attempt struct {
	n          int32
	retryID    string
	status     meshv1.NodeStatus
	cause      meshv1.CancelCause
	code       string
	start, end time.Time
}

// attemptsOf returns a node's attempts in order: its earlier attempts, then the current one.
func attemptsOf(n *meshv1.Node) []attempt {
	var out []attempt
	for _, a := range n.GetEarlierAttempts() {
		out = append(out, attempt{a.GetAttempt(), a.GetRetryId(), a.GetStatus(), a.GetCause(), a.GetErrorCode(),
			a.GetStartedAt().AsTime(), a.GetEndedAt().AsTime()})
	}
	return append(out, attempt{n.GetAttempt(), n.GetRetryId(), n.GetStatus(), n.GetCause(), n.GetErrorCode(),
		n.GetStartedAt().AsTime(), n.GetEndedAt().AsTime()})
}

func fmtAttempts(as []attempt) string {
	var b strings.Builder
	for _, a := range as {
		fmt.Fprintf(&b, "\n    attempt %d retry-id %s %s cause %s code %q %s → %s", a.n, a.retryID, a.status, a.cause, a.code, fmtTime(a.start), fmtTime(a.end))
	}
	return b.String()
}

// finishedRun returns the run's summary: the one the Run stream carried, else GetRun's.
func finishedRun(ctx context.Context, t *testing.T, c orchestratorv1.OrchestratorServiceClient, res result) *orchestratorv1.Run {
	t.Helper()
	if res.finished != nil {
		return res.finished
	}
	if res.started == nil {
		t.Fatalf("the run never started: %v", res.err)
	}
	return summary(ctx, t, c, res.started.GetRunId())
}

// sample is one series of a /metrics page.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

// scrape reads a service's /metrics (Prometheus text format).
func scrape(t *testing.T, m *meshproc.Mesh, service string) []sample {
	t.Helper()
	body, err := httpGet("http://" + m.Endpoints.Services[service].AdminAddr + "/metrics")
	if err != nil {
		t.Fatalf("%s /metrics: %v", service, err)
	}
	var out []sample
	for line := range strings.Lines(body) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		s, err := parseSample(line)
		if err != nil {
			t.Fatalf("%s /metrics: %v", service, err)
		}
		out = append(out, s)
	}
	return out
}

func parseSample(line string) (sample, error) {
	s := sample{labels: map[string]string{}}
	i := strings.IndexAny(line, "{ ")
	if i < 0 {
		return s, fmt.Errorf("bad line %q", line)
	}
	s.name, line = line[:i], line[i:]
	if line[0] == '{' {
		line = line[1:]
		for {
			line = strings.TrimLeft(line, ", ")
			if strings.HasPrefix(line, "}") {
				line = line[1:]
				break
			}
			eq := strings.Index(line, `="`)
			if eq < 0 {
				return s, fmt.Errorf("bad labels in %q", line)
			}
			key, rest := line[:eq], line[eq+2:]
			var val strings.Builder
			j := 0
			for ; j < len(rest) && rest[j] != '"'; j++ {
				if rest[j] == '\\' && j+1 < len(rest) {
					j++
				}
				val.WriteByte(rest[j])
			}
			if j == len(rest) {
				return s, fmt.Errorf("unterminated label value in %q", line)
			}
			s.labels[key], line = val.String(), rest[j+1:]
		}
	}
	f := strings.Fields(line)
	if len(f) == 0 {
		return s, fmt.Errorf("no value in %q", line)
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return s, fmt.Errorf("bad value in %q: %w", line, err)
	}
	s.value = v
	return s, nil
}

// sum adds the values of the series called name whose labels include match.
func sum(ss []sample, name string, match map[string]string) float64 {
	var total float64
	for _, s := range ss {
		if s.name != name {
			continue
		}
		ok := true
		for k, v := range match {
			if s.labels[k] != v {
				ok = false
				break
			}
		}
		if ok {
			total += s.value
		}
	}
	return total
}

func names(ss []sample) map[string]bool {
	out := map[string]bool{}
	for _, s := range ss {
		out[s.name] = true
	}
	return out
}

// scrapeAll reads every service's /metrics.
func scrapeAll(t *testing.T, m *meshproc.Mesh) map[string][]sample {
	t.Helper()
	out := map[string][]sample{}
	for svc := range m.Endpoints.Services {
		out[svc] = scrape(t, m, svc)
	}
	return out
}

// A tool that fails UNAVAILABLE twice succeeds on its third attempt. toolrunner's record
// of the node shows attempt 3 with 2 earlier attempts, all of one retry-id. Bounds: each
// gap (an attempt's end → the next one's start, both on toolrunner's clock) is ≥ 0 and at
// most its full-jitter ceiling 25ms·2^(n−2) (capped at 250 ms) plus schedMargin (200 ms);
// the delays the orchestrator slept, from its own histogram, are each ≤ their ceiling
// (all 10 in bucket le=0.05, at least the 5 before attempt 2 in le=0.025) and sum to at
// most 5·(25+50) ms; over 5 runs the gaps are not all
// the same (jitter).
func TestRetryBackoffFullJitter(t *testing.T) {
	const runs = 5
	ctx := context.Background()
	c := client(t)
	plan := fastPlan(`{"name": "fail", "args": {"times": 2}}`)
	if backoffCeiling(3) <= backoffCeiling(2) || backoffCeiling(2) != backoffBase || backoffCeiling(10) != backoffCap {
		t.Fatalf("ceilings must grow from the base to the cap: %v %v %v", backoffCeiling(2), backoffCeiling(3), backoffCeiling(10))
	}
	before := scrape(t, mesh, "orchestrator")
	gaps := map[int][]time.Duration{} // attempt n → gaps before it, one per run
	for i := range runs {
		res, _ := runPlan(ctx, c, plan, 20*time.Second, 0, false)
		if res.err != nil {
			t.Fatalf("run %d: %v", i, res.err)
		}
		r := finishedRun(ctx, t, c, res)
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("run %d: %s\n%s", i, r.GetStatus(), dump(r))
		}
		n := nodeMap(r)["root/s0.t0"]
		as := attemptsOf(n)
		if n.GetAttempt() != 3 || len(n.GetEarlierAttempts()) != 2 {
			t.Fatalf("run %d: fail tool at attempt %d with %d earlier attempts, want attempt 3 with 2:%s", i, n.GetAttempt(), len(n.GetEarlierAttempts()), fmtAttempts(as))
		}
		for k, a := range as {
			if a.n != int32(k+1) || a.retryID == "" || a.retryID != as[0].retryID {
				t.Errorf("run %d: attempt %d: number %d, retry-id %q; want %d and one retry-id for all:%s", i, k+1, a.n, a.retryID, k+1, fmtAttempts(as))
			}
			want, code := meshv1.NodeStatus_NODE_STATUS_FAILED, "UNAVAILABLE"
			if k == len(as)-1 {
				want, code = meshv1.NodeStatus_NODE_STATUS_SUCCEEDED, ""
			}
			if a.status != want || a.code != code {
				t.Errorf("run %d: attempt %d %s %q, want %s %q", i, k+1, a.status, a.code, want, code)
			}
		}
		for k := 1; k < len(as); k++ {
			next := k + 1 // the attempt this gap precedes
			gap := as[k].start.Sub(as[k-1].end)
			if gap < 0 || gap > backoffCeiling(next)+schedMargin {
				t.Errorf("run %d: gap before attempt %d is %v, want within [0, %v + %v]", i, next, gap, backoffCeiling(next), schedMargin)
			}
			gaps[next] = append(gaps[next], gap)
		}
	}
	t.Logf("gaps before attempt 2 (ceiling %v): %v", backoffCeiling(2), gaps[2])
	t.Logf("gaps before attempt 3 (ceiling %v): %v", backoffCeiling(3), gaps[3])
	for n, gs := range gaps {
		if slices.Min(gs) == slices.Max(gs) {
			t.Errorf("the gaps before attempt %d are all %v over %d runs: no jitter", n, gs[0], runs)
		}
	}
	// The delays actually slept, from the orchestrator's histogram: two per run, each
	// below its ceiling (the largest, 50 ms, is a bucket bound).
	after := scrape(t, mesh, "orchestrator")
	lbl := map[string]string{"target": "toolrunner", "method": executeMethod}
	count := sum(after, "curfew_backoff_delay_seconds_count", lbl) - sum(before, "curfew_backoff_delay_seconds_count", lbl)
	slept := sum(after, "curfew_backoff_delay_seconds_sum", lbl) - sum(before, "curfew_backoff_delay_seconds_sum", lbl)
	le := map[string]string{"target": "toolrunner", "method": executeMethod, "le": "0.05"}
	under := sum(after, "curfew_backoff_delay_seconds_bucket", le) - sum(before, "curfew_backoff_delay_seconds_bucket", le)
	le["le"] = "0.025"
	under25 := sum(after, "curfew_backoff_delay_seconds_bucket", le) - sum(before, "curfew_backoff_delay_seconds_bucket", le)
	maxSlept := runs * (backoffCeiling(2) + backoffCeiling(3)).Seconds()
	if count != 2*runs || under != count || under25 < runs || slept < 0 || slept > maxSlept+1e-9 {
		t.Errorf("orchestrator slept %v backoffs (%v of them ≤ 50ms, %v ≤ 25ms) totalling %.4fs; want %d, all ≤ 50ms, at least %d (those before attempt 2) ≤ 25ms, total ≤ %.3fs",
			count, under, under25, slept, 2*runs, runs, maxSlept)
	}
}

// A model that fails at the leaf of orchestrator → subagent → subagent costs at most 3
// decoder attempts, not 9 or 27: the leaf's caller retries to exhaustion and marks the
// error, and no layer above retries it. Bounds: the leaf decoder's record (modelproxy)
// shows exactly 3 attempts of one retry-id; every subagent node and spawn tool node has
// one attempt; across the whole mesh's /metrics exactly 2 retries were made, both by
// subagent to modelproxy; the run fails UNAVAILABLE.
func TestRetryOneLayerModelFailure(t *testing.T) {
	const leaf = "root/s0.t0/sub/s0.t0/sub/m0"
	plan := fastPlan(`{"name": "spawn_subagent", "args": {"plan": ` +
		fastPlan(`{"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 1000, "steps": [{"answer_tokens": 5, "model_error": {"attempts": 100}}]}}}`) + `}}`)
	ctx := context.Background()
	c := client(t)
	before := scrapeAll(t, mesh)
	res, _ := runPlan(ctx, c, plan, 20*time.Second, 0, false)
	if code(res.err) != codes.Unavailable.String() {
		t.Fatalf("Run ended with %v, want UNAVAILABLE", res.err)
	}
	r := finishedRun(ctx, t, c, res)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED || r.GetErrorCode() != "UNAVAILABLE" {
		t.Fatalf("run: %s %s, want FAILED UNAVAILABLE\n%s", r.GetStatus(), r.GetErrorCode(), dump(r))
	}
	// The leaf decoder, as modelproxy itself recorded it.
	mp, err := mesh.Report("modelproxy")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := mp.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: r.GetRunId(), NodePrefixes: []string{leaf}, SettleTimeout: durationpb.New(5 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetNodes()) != 1 {
		t.Fatalf("modelproxy has %d records of %s, want 1:\n%s", len(resp.GetNodes()), leaf, dump(r))
	}
	as := attemptsOf(resp.GetNodes()[0])
	if len(as) > 3 {
		t.Errorf("the leaf decoder ran %d attempts, at most 3 allowed:%s", len(as), fmtAttempts(as))
	}
	if len(as) != 3 {
		t.Errorf("the leaf decoder ran %d attempts, want 3 (its caller's full allowance):%s", len(as), fmtAttempts(as))
	}
	for k, a := range as {
		if a.n != int32(k+1) || a.retryID == "" || a.retryID != as[0].retryID || a.code != "UNAVAILABLE" {
			t.Errorf("leaf attempt %d: number %d retry-id %q code %q, want numbered in order, one retry-id, UNAVAILABLE:%s", k+1, a.n, a.retryID, a.code, fmtAttempts(as))
		}
	}
	// Every layer above made one attempt.
	ns := nodeMap(r)
	for _, id := range []string{"root/s0.t0", "root/s0.t0/sub", "root/s0.t0/sub/s0.t0", "root/s0.t0/sub/s0.t0/sub", "root/m0", "root/s0.t0/sub/m0"} {
		n := ns[id]
		if n == nil {
			t.Errorf("node %s missing", id)
			continue
		}
		if n.GetAttempt() > 1 || len(n.GetEarlierAttempts()) != 0 {
			t.Errorf("node %s: attempt %d with %d earlier attempts, want one attempt:%s", id, n.GetAttempt(), len(n.GetEarlierAttempts()), fmtAttempts(attemptsOf(n)))
		}
	}
	// The mesh's own count: the only retries are the leaf's two.
	after := scrapeAll(t, mesh)
	retried := map[string]float64{}
	var total float64
	for svc := range after {
		for _, target := range []string{"modelproxy", "toolrunner", "subagent"} {
			m := map[string]string{"target": target, "retry": "true"}
			if d := sum(after[svc], "curfew_retry_attempts_total", m) - sum(before[svc], "curfew_retry_attempts_total", m); d != 0 {
				retried[svc+"→"+target] = d
				total += d
			}
		}
	}
	if total != 2 || retried["subagent→modelproxy"] != 2 {
		t.Errorf("retries made across the mesh: %v, want only subagent→modelproxy: 2", retried)
	}
	if t.Failed() {
		t.Logf("%s", dump(r))
	}
}

// genStream is what a client saw of one Generate attempt.
type genStream struct {
	tokens int
	first  time.Time // first token
	end    time.Time // the stream's end
	err    error
}

// A second attempt with the same retry-id supersedes the first while it decodes: the
// first attempt's stream ends before the second's first token, modelproxy's record shows
// the earlier attempt ended (cause SUPERSEDED) before the current one started, and the
// decoders' ledger shows no token of either attempt in the other's time. Bounds: token
// counts from the ledger split exactly at the earlier attempt's end and at the current
// attempt's start; the earlier attempt's ledger count is within 1 of what its client
// received; curfew_superseded_total{method=Generate} rose by exactly 1.
func TestSupersedeDuplicateAttempt(t *testing.T) {
	ctx := context.Background()
	before := scrape(t, mesh, "modelproxy")
	run := fmt.Sprintf("e2e-supersede-%d", time.Now().UnixNano())
	const node = "root/m0"
	rid := "rid-" + run
	s1, s2 := supersede(ctx, t, run, node, rid)

	if !s1.end.Before(s2.first) {
		t.Errorf("attempt 1's stream ended at %s, not before attempt 2's first token at %s", fmtTime(s1.end), fmtTime(s2.first))
	}
	if st := status.Convert(s1.err); st.Code() != codes.Canceled {
		t.Errorf("attempt 1's stream ended with %v, want CANCELLED (superseded)", s1.err)
	}
	mp, err := mesh.Report("modelproxy")
	if err != nil {
		t.Fatal(err)
	}
	list := func(at *timestamppb.Timestamp) *meshv1.Node {
		resp, err := mp.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(5 * time.Second), CancelAt: at})
		if err != nil {
			t.Fatal(err)
		}
		if !resp.GetSettled() || len(resp.GetNodes()) != 1 || resp.GetNodes()[0].GetId() != node {
			t.Fatalf("modelproxy's nodes of run %s: settled %v, %v", run, resp.GetSettled(), resp.GetNodes())
		}
		return resp.GetNodes()[0]
	}
	n := list(nil)
	as := attemptsOf(n)
	if len(as) != 2 {
		t.Fatalf("modelproxy recorded %d attempts, want 2:%s", len(as), fmtAttempts(as))
	}
	first, cur := as[0], as[1]
	if first.n != 1 || cur.n != 2 || first.retryID != rid || cur.retryID != rid {
		t.Errorf("attempts %d and %d with retry-ids %q, %q; want 1 and 2 of %q", first.n, cur.n, first.retryID, cur.retryID, rid)
	}
	if first.status != meshv1.NodeStatus_NODE_STATUS_CANCELLED || first.cause != meshv1.CancelCause_CANCEL_CAUSE_SUPERSEDED {
		t.Errorf("the earlier attempt ended %s cause %s, want CANCELLED cause SUPERSEDED", first.status, first.cause)
	}
	if first.end.IsZero() || cur.start.Before(first.end) {
		t.Errorf("the earlier attempt ended at %s, after the current one started at %s: two decoders overlapped", fmtTime(first.end), fmtTime(cur.start))
	}
	// The ledger, split at the earlier attempt's end and at the current one's start: the
	// same split, so no token was emitted between them, and none by attempt 1 afterwards.
	atEnd := list(n.GetEarlierAttempts()[0].GetEndedAt())
	atStart := list(n.GetStartedAt())
	if atEnd.GetTokensAtCancel() != atStart.GetTokensAtCancel() || atEnd.GetTokensAfterCancel() != atStart.GetTokensAfterCancel() {
		t.Errorf("ledger split at attempt 1's end %d+%d, at attempt 2's start %d+%d: tokens between or interleaved",
			atEnd.GetTokensAtCancel(), atEnd.GetTokensAfterCancel(), atStart.GetTokensAtCancel(), atStart.GetTokensAfterCancel())
	}
	if b := atEnd.GetTokensAtCancel(); b < int64(s1.tokens) || b > int64(s1.tokens)+1 {
		t.Errorf("ledger shows %d tokens before attempt 1 ended, its client received %d", b, s1.tokens)
	}
	if a := atEnd.GetTokensAfterCancel(); a < int64(s2.tokens) {
		t.Errorf("ledger shows %d tokens of attempt 2, its client received %d", a, s2.tokens)
	}
	after := scrape(t, mesh, "modelproxy")
	m := map[string]string{"method": generateMethod}
	if d := sum(after, "curfew_superseded_total", m) - sum(before, "curfew_superseded_total", m); d != 1 {
		t.Errorf("curfew_superseded_total{method=Generate} rose by %v, want 1", d)
	}
	if v := sum(after, "curfew_inflight_by_retry_id_max", m); v != 1 {
		t.Errorf("curfew_inflight_by_retry_id_max{method=Generate} = %v, want 1 (attempts of a retry-id never overlap)", v)
	}
	if v := sum(after, "curfew_inflight_by_retry_id", m); v != 0 {
		t.Errorf("curfew_inflight_by_retry_id{method=Generate} = %v after the calls ended, want 0", v)
	}
	t.Logf("attempt 1: %d tokens, ended %s (%v); attempt 2: first token %s, %d tokens%s", s1.tokens, fmtTime(s1.end), s1.err, fmtTime(s2.first), s2.tokens, fmtAttempts(as))
}

// supersede calls modelproxy's Generate directly with a long decode as attempt 1 of
// retry-id rid, waits for a few tokens, then starts attempt 2 with the same retry-id,
// reads a few of its tokens and cancels it. It returns what each stream saw.
func supersede(ctx context.Context, t *testing.T, run, node, rid string) (s1, s2 genStream) {
	t.Helper()
	const plan = `{"tokens_per_second": 40, "steps": [{"answer_tokens": 400}]}`
	const few = 3
	// As the orchestrator: with mTLS, modelproxy serves Generate to the mesh's callers only.
	conn, err := mesh.ConnAs(meshtls.Orchestrator, "modelproxy")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	mp := modelproxyv1.NewModelProxyServiceClient(conn)
	// read receives one attempt's stream until it ends, signalling after n tokens.
	read := func(st grpc.ServerStreamingClient[modelproxyv1.GenerateResponse], n int, got chan<- struct{}, out *genStream) {
		for {
			resp, err := st.Recv()
			if err != nil {
				out.end, out.err = time.Now(), err
				return
			}
			if resp.GetTokens() > 0 {
				if out.tokens == 0 {
					out.first = time.Now()
				}
				out.tokens++
				if out.tokens == n {
					close(got)
				}
			}
		}
	}
	open := func(actx context.Context, attempt int) grpc.ServerStreamingClient[modelproxyv1.GenerateResponse] {
		actx = metadata.AppendToOutgoingContext(actx, "curfew-run-id", run, "curfew-node-id", node,
			"curfew-retry-id", rid, "curfew-attempt", strconv.Itoa(attempt))
		st, err := mp.Generate(actx, &modelproxyv1.GenerateRequest{Model: "sim",
			Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: plan}}})
		if err != nil {
			t.Fatalf("attempt %d: %v", attempt, err)
		}
		return st
	}
	wait := func(ch <-chan struct{}, what string) {
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Fatalf("timed out waiting for %s", what)
		}
	}
	ctx1, cancel1 := context.WithTimeout(ctx, 30*time.Second)
	defer cancel1()
	got1, done1 := make(chan struct{}), make(chan struct{})
	st1 := open(ctx1, 1)
	go func() { defer close(done1); read(st1, few, got1, &s1) }()
	wait(got1, "attempt 1's first tokens")

	ctx2, cancel2 := context.WithTimeout(ctx, 30*time.Second)
	defer cancel2()
	got2, done2 := make(chan struct{}), make(chan struct{})
	st2 := open(ctx2, 2)
	go func() { defer close(done2); read(st2, few, got2, &s2) }()
	wait(done1, "attempt 1's stream to end")
	wait(got2, "attempt 2's first tokens")
	cancel2()
	wait(done2, "attempt 2's stream to end")
	if errors.Is(s2.err, io.EOF) {
		t.Fatalf("attempt 2 decoded to the end; it should have been cancelled")
	}
	return s1, s2
}

// With 2 s left, a pushback of 3 s would end past the deadline: no retry is made and the
// run fails at once with DEADLINE_EXCEEDED saying there is no time left to retry. Bounds:
// one attempt (attempt 1, no earlier attempts); the error reaches the client before the
// run's deadline.
func TestPushbackPastDeadlineNotRetried(t *testing.T) {
	ctx := context.Background()
	c := client(t)
	plan := fastPlan(`{"name": "fail", "args": {"times": 1, "pushback_ms": 3000}}`)
	res, _ := runPlan(ctx, c, plan, 2*time.Second, 0, false)
	if code(res.err) != codes.DeadlineExceeded.String() || !strings.Contains(status.Convert(res.err).Message(), "no time left to retry") {
		t.Fatalf("Run ended with %v, want DEADLINE_EXCEEDED: no time left to retry", res.err)
	}
	r := finishedRun(ctx, t, c, res)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED || !strings.Contains(r.GetErrorMessage(), "no time left to retry") {
		t.Errorf("run: %s %q, want DEADLINE_EXCEEDED with no time left to retry", r.GetStatus(), r.GetErrorMessage())
	}
	if dl := r.GetDeadline().AsTime(); !res.errAt.Before(dl) {
		t.Errorf("the error reached the client at %s, not before the deadline %s: it waited instead of failing", fmtTime(res.errAt), fmtTime(dl))
	}
	n := nodeMap(r)["root/s0.t0"]
	if n.GetAttempt() != 1 || len(n.GetEarlierAttempts()) != 0 || n.GetErrorCode() != "UNAVAILABLE" {
		t.Errorf("fail tool: attempt %d with %d earlier attempts, %s; want one UNAVAILABLE attempt:%s", n.GetAttempt(), len(n.GetEarlierAttempts()), n.GetErrorCode(), fmtAttempts(attemptsOf(n)))
	}
	if t.Failed() {
		t.Logf("%s", dump(r))
	}
}

// A server's pushback replaces the backoff. Bounds: a 500 ms pushback (trailer, or a
// RetryInfo detail on RESOURCE_EXHAUSTED) puts ≥ 500 ms and < 500 ms + pushbackMargin
// (400 ms) between attempt 1's end and attempt 2's start; RESOURCE_EXHAUSTED without a
// pushback, and a pushback of -1 ("don't retry"), give exactly one attempt.
func TestPushbackHonoured(t *testing.T) {
	const push = 500 * time.Millisecond
	ctx := context.Background()
	c := client(t)
	for _, tc := range []struct {
		name, tool string
		attempts   int
		fail       codes.Code // the run's error; OK when it succeeds
	}{
		{"trailer", `{"name": "fail", "args": {"times": 1, "pushback_ms": 500}}`, 2, codes.OK},
		{"retry_info", `{"name": "fail", "args": {"times": 1, "code": "RESOURCE_EXHAUSTED", "retry_info_ms": 500}}`, 2, codes.OK},
		{"resource_exhausted_without_pushback", `{"name": "fail", "args": {"times": 1, "code": "RESOURCE_EXHAUSTED"}}`, 1, codes.ResourceExhausted},
		{"dont_retry", `{"name": "fail", "args": {"times": 1, "pushback_ms": -1}}`, 1, codes.Unavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res, _ := runPlan(ctx, c, fastPlan(tc.tool), 20*time.Second, 0, false)
			r := finishedRun(ctx, t, c, res)
			if status.Code(res.err) != tc.fail {
				t.Fatalf("Run ended with %v, want %s\n%s", res.err, tc.fail, dump(r))
			}
			if tc.fail == codes.OK && r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
				t.Fatalf("run %s, want success\n%s", r.GetStatus(), dump(r))
			}
			n := nodeMap(r)["root/s0.t0"]
			as := attemptsOf(n)
			if len(as) != tc.attempts || n.GetAttempt() != int32(tc.attempts) {
				t.Fatalf("fail tool ran %d attempts (current %d), want %d:%s", len(as), n.GetAttempt(), tc.attempts, fmtAttempts(as))
			}
			if tc.attempts == 2 {
				gap := as[1].start.Sub(as[0].end)
				if gap < push || gap >= push+pushbackMargin {
					t.Errorf("gap between attempts %v, want ≥ %v and < %v", gap, push, push+pushbackMargin)
				}
				if as[0].retryID == "" || as[0].retryID != as[1].retryID {
					t.Errorf("retry-ids %q and %q, want one", as[0].retryID, as[1].retryID)
				}
				t.Logf("gap between attempts: %v", gap)
			}
		})
	}
}

// Under a sustained 100% failure of toolrunner, the orchestrator's retries stay within
// its budget. A dedicated mesh runs with CURFEW_RETRY_BUDGET_PER_SECOND=1: over the
// budget's 10 s window the floor is 1/s × 10 s = 10 retries, on top of 20 % of the calls.
// 80 runs, 16 at a time, each call a fail tool with times 100 (3 attempts each without a
// budget: 160 retries). Bound, from the orchestrator's /metrics for target toolrunner:
// retries ≤ 0.2 × calls + 10 when the burst fits in one window (< 9 s; calls are all the
// logical calls the orchestrator made to toolrunner, the summaries' ListNodes included,
// since the budget counts them all); else ≤ 0.4 × calls + 10 × ⌈span/10 s⌉ (each window
// overlaps two 10 s blocks). curfew_retry_budget_exhausted_total{target="toolrunner"} > 0,
// and the toolrunner's node records count the same Execute attempts.
func TestBudgetCapsRetryStorm(t *testing.T) {
	const (
		runs      = 80
		inFlight  = 16
		perSecond = 1
		window    = 10 * time.Second
		ratio     = 0.2
	)
	floor := perSecond * window.Seconds()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	m, err := meshproc.Start(ctx, t.TempDir(), meshproc.Options{Env: []string{"CURFEW_RETRY_BUDGET_PER_SECOND=" + strconv.Itoa(perSecond)}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := m.Stop(); err != nil {
			t.Errorf("dedicated mesh did not stop cleanly: %v", err)
		}
	}()
	c, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	plan := fastPlan(`{"name": "fail", "args": {"times": 100}}`)
	before := scrape(t, m, "orchestrator")
	results := make([]result, runs)
	sem := make(chan struct{}, inFlight)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range results {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			results[i], _ = runPlan(ctx, c, plan, 20*time.Second, 0, false)
		}()
	}
	wg.Wait()
	span := time.Since(start)
	after := scrape(t, m, "orchestrator")

	delta := func(name string, lbl map[string]string) float64 {
		return sum(after, name, lbl) - sum(before, name, lbl)
	}
	tr := map[string]string{"target": "toolrunner"}
	calls := delta("curfew_retry_attempts_total", map[string]string{"target": "toolrunner", "retry": "false"})
	retries := delta("curfew_retry_attempts_total", map[string]string{"target": "toolrunner", "retry": "true"})
	execCalls := delta("curfew_retry_attempts_total", map[string]string{"target": "toolrunner", "method": executeMethod, "retry": "false"})
	execRetries := delta("curfew_retry_attempts_total", map[string]string{"target": "toolrunner", "method": executeMethod, "retry": "true"})
	exhausted := delta("curfew_retry_budget_exhausted_total", tr)

	var nodeAttempts int
	for i, res := range results {
		if code(res.err) != codes.Unavailable.String() {
			t.Errorf("run %d ended with %v, want UNAVAILABLE", i, res.err)
			continue
		}
		r := finishedRun(ctx, t, c, res)
		n := nodeMap(r)["root/s0.t0"]
		if n == nil {
			t.Errorf("run %d: no fail tool node\n%s", i, dump(r))
			continue
		}
		nodeAttempts += len(attemptsOf(n))
	}
	bound := ratio*calls + floor
	how := "one window"
	if span >= window-time.Second {
		blocks := math.Ceil(span.Seconds() / window.Seconds())
		bound, how = 2*ratio*calls+floor*blocks, fmt.Sprintf("%v blocks of %v", blocks, window)
	}
	t.Logf("%d runs in %v (%s): orchestrator→toolrunner calls %v (Execute %v), retries %v (Execute %v), bound %v; budget exhausted %v; toolrunner recorded %d Execute attempts",
		runs, span.Round(time.Millisecond), how, calls, execCalls, retries, execRetries, bound, exhausted, nodeAttempts)
	if execCalls != runs {
		t.Errorf("%v Execute calls, want %d", execCalls, runs)
	}
	if retries > bound {
		t.Errorf("%v attempts for %v calls: %v retries exceed the budget's %v (%s)", calls+retries, calls, retries, bound, how)
	}
	if exhausted <= 0 {
		t.Errorf("curfew_retry_budget_exhausted_total{target=toolrunner} rose by %v, want > 0", exhausted)
	}
	if float64(nodeAttempts) != execCalls+execRetries {
		t.Errorf("toolrunner recorded %d Execute attempts, the orchestrator counted %v", nodeAttempts, execCalls+execRetries)
	}
	if !names(after)["curfew_retry_budget_exhausted_total"] {
		t.Errorf("the orchestrator's /metrics has no curfew_retry_budget_exhausted_total after the budget ran out")
	}
}

// A tool with side effects is retried only with an idempotency key. deploy loses its
// acknowledgement on attempt 1 (the job has started). Bounds: without a key the run
// fails UNAVAILABLE after exactly one attempt and curfew_tool_effects_total{tool=deploy}
// rises by 1; with a key the run succeeds, toolrunner's node shows 2 attempts of one
// retry-id, and the effects counter rises by exactly 1 (the retry attached to the job).
func TestSideEffectRetriedOnlyWithKey(t *testing.T) {
	ctx := context.Background()
	c := client(t)
	effects := func() float64 {
		return sum(scrape(t, mesh, "toolrunner"), "curfew_tool_effects_total", map[string]string{"tool": "deploy"})
	}
	args := `"args": {"duration_ms": 200, "poll_ms": 20, "fail_attempts": 1}`

	t.Run("without_key", func(t *testing.T) {
		before := effects()
		res, _ := runPlan(ctx, c, fastPlan(`{"name": "deploy", `+args+`}`), 20*time.Second, 0, false)
		if code(res.err) != codes.Unavailable.String() {
			t.Fatalf("Run ended with %v, want UNAVAILABLE", res.err)
		}
		r := finishedRun(ctx, t, c, res)
		n := nodeMap(r)["root/s0.t0"]
		if n.GetAttempt() != 1 || len(n.GetEarlierAttempts()) != 0 || n.GetErrorCode() != "UNAVAILABLE" {
			t.Errorf("deploy: attempt %d with %d earlier attempts, %s; want one UNAVAILABLE attempt:%s", n.GetAttempt(), len(n.GetEarlierAttempts()), n.GetErrorCode(), fmtAttempts(attemptsOf(n)))
		}
		if d := effects() - before; d != 1 {
			t.Errorf("curfew_tool_effects_total{tool=deploy} rose by %v, want 1", d)
		}
	})
	t.Run("with_key", func(t *testing.T) {
		before := effects()
		key := fmt.Sprintf("k-%d", time.Now().UnixNano())
		res, _ := runPlan(ctx, c, fastPlan(`{"name": "deploy", "idempotency_key": "`+key+`", `+args+`}`), 20*time.Second, 0, false)
		if res.err != nil {
			t.Fatalf("Run: %v", res.err)
		}
		r := finishedRun(ctx, t, c, res)
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("run %s\n%s", r.GetStatus(), dump(r))
		}
		n := nodeMap(r)["root/s0.t0"]
		as := attemptsOf(n)
		if len(as) != 2 || n.GetAttempt() != 2 || as[0].code != "UNAVAILABLE" || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED ||
			as[0].retryID == "" || as[0].retryID != as[1].retryID {
			t.Errorf("deploy: want a failed attempt 1 and a successful attempt 2 of one retry-id:%s", fmtAttempts(as))
		}
		if d := effects() - before; d != 1 {
			t.Errorf("curfew_tool_effects_total{tool=deploy} rose by %v, want exactly 1 (one job started)", d)
		}
	})
}

// Every service's /metrics exposes the retry metrics of its role once they have been
// exercised (a series appears with its first label values): the client-side ones where
// the service calls others and retried, the in-flight table's where calls carrying a
// retry-id arrive, supersedes where one happened, tool effects at toolrunner. The test
// exercises each path itself: a fail tool, a deploy and a subagent whose model fails once,
// then a superseded decode. curfew_retry_budget_exhausted_total appears only once a budget
// ran out: TestBudgetCapsRetryStorm checks it on its own mesh.
func TestRetryMetricNames(t *testing.T) {
	ctx := context.Background()
	c := client(t)
	plan := fastPlan(`{"name": "fail", "args": {"times": 1}},
	  {"name": "deploy", "args": {"duration_ms": 50, "poll_ms": 10}},
	  {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 1000, "steps": [{"answer_tokens": 2, "model_error": {"attempts": 1}}]}}}`)
	res, _ := runPlan(ctx, c, plan, 20*time.Second, 0, false)
	if res.err != nil {
		t.Fatalf("Run: %v", res.err)
	}
	run := fmt.Sprintf("e2e-names-%d", time.Now().UnixNano())
	supersede(ctx, t, run, "root/m0", "rid-"+run)

	const (
		attempts   = "curfew_retry_attempts_total"
		backoff    = "curfew_backoff_delay_seconds"
		exhausted  = "curfew_retry_budget_exhausted_total"
		inflight   = "curfew_inflight_by_retry_id"
		inflightMx = "curfew_inflight_by_retry_id_max"
		superseded = "curfew_superseded_total"
		effects    = "curfew_tool_effects_total"
	)
	all := []string{attempts, backoff, exhausted, inflight, inflightMx, superseded, effects}
	want := map[string][]string{
		// calls modelproxy, toolrunner and subagent, and retried the fail tool; receives
		// Run from clients, which carry no retry-id.
		"orchestrator": {attempts, backoff},
		// calls subagent (spawn); receives the orchestrator's calls; runs deploy.
		"toolrunner": {attempts, inflight, inflightMx, effects},
		// calls modelproxy and retried the failing model step; receives toolrunner's calls.
		"subagent": {attempts, backoff, inflight, inflightMx},
		// calls nothing; receives retry-ids, and superseded one.
		"modelproxy": {inflight, inflightMx, superseded},
	}
	for svc, ns := range want {
		got := names(scrape(t, mesh, svc))
		var absent []string
		for _, n := range all {
			if !got[n] && !got[n+"_count"] {
				absent = append(absent, n)
			}
		}
		for _, n := range ns {
			if slices.Contains(absent, n) {
				t.Errorf("%s /metrics has no %s", svc, n)
			}
		}
		t.Logf("%s: absent (not exercised on this service): %v", svc, absent)
	}
}
