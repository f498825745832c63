package orchestrator

import (
	"context"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

func TestRunSucceeds(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	before := time.Now()
	rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: fastPlan})
	if dl := started.GetDeadline().AsTime(); dl.Before(before.Add(deadline.DefaultTimeout-time.Second)) || dl.After(time.Now().Add(deadline.DefaultTimeout)) {
		t.Fatalf("deadline %v, want the service default %v from now", dl, deadline.DefaultTimeout)
	}
	evs, err := rs.rest()
	if err != nil {
		t.Fatalf("Run: %v, want OK", err)
	}
	if len(evs) < 2 {
		t.Fatalf("events = %v", evs)
	}
	// Node updates and the model nodes' text, then the summary last.
	var order []string
	text := map[string]string{}
	ended := map[string]bool{}
	for _, ev := range evs[:len(evs)-1] {
		if d := ev.GetNodeEvent().GetText(); d != nil {
			id := ev.GetNodeEvent().GetNodeId()
			if ended[id] || int(d.GetOffset()) != len(text[id]) {
				t.Fatalf("text %v of %s after its end or out of order (%d bytes before)", d, id, len(text[id]))
			}
			text[id] += d.GetText()
			continue
		}
		n := ev.GetNode()
		if n == nil {
			t.Fatalf("event %v before the summary is not a node update nor text", ev)
		}
		ended[n.GetId()] = n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING
		order = append(order, n.GetId()+" "+strings.TrimPrefix(n.GetStatus().String(), "NODE_STATUS_"))
	}
	idx := func(s string) int {
		for i, o := range order {
			if o == s {
				return i
			}
		}
		t.Fatalf("no event %q in %v", s, order)
		return -1
	}
	inOrder := idx("root/m0 RUNNING") < idx("root/m0 SUCCEEDED") &&
		idx("root/m0 SUCCEEDED") < idx("root/s0.t0 RUNNING") &&
		idx("root/s0.t0 SUCCEEDED") < idx("root/m1 RUNNING") &&
		idx("root/s0.t1 SUCCEEDED") < idx("root/m1 RUNNING") &&
		idx("root/m1 SUCCEEDED") < idx("root SUCCEEDED") &&
		idx("root SUCCEEDED") == len(order)-1
	if !inOrder {
		t.Fatalf("node events out of order: %v", order)
	}

	r := evs[len(evs)-1].GetFinished()
	if r == nil || r.GetRunId() != started.GetRunId() {
		t.Fatalf("last event = %v, want the summary of run %s", evs[len(evs)-1], started.GetRunId())
	}
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || r.GetAnswer() != "w w w w w " ||
		r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED || r.GetCancelledAt() != nil || r.GetErrorCode() != "" {
		t.Fatalf("summary = %v, want SUCCEEDED with the answer", r)
	}
	if text["root/m1"] != r.GetAnswer() {
		t.Fatalf("the answer step streamed %q, want the answer %q", text["root/m1"], r.GetAnswer())
	}
	if r.GetModel() != agent.DefaultModel || r.GetTask() != fastPlan || r.GetTenant() != md.DefaultTenant || r.GetEndedAt() == nil {
		t.Fatalf("summary fields = %v", r)
	}
	if !r.GetDeadline().AsTime().Equal(started.GetDeadline().AsTime()) {
		t.Fatalf("summary deadline %v != started deadline %v", r.GetDeadline().AsTime(), started.GetDeadline().AsTime())
	}
	// The summary's nodes and tokens come from the executors' reports.
	var ids []string
	for _, n := range r.GetNodes() {
		ids = append(ids, n.GetId())
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			t.Fatalf("node %v did not succeed", n)
		}
	}
	if strings.Join(ids, ",") != "root,root/m0,root/m1,root/s0.t0,root/s0.t1" {
		t.Fatalf("summary nodes = %v", ids)
	}
	if nodeOf(t, r, "root").GetKind() != meshv1.NodeKind_NODE_KIND_RUN || nodeOf(t, r, "root/s0.t0").GetKind() != meshv1.NodeKind_NODE_KIND_TOOL {
		t.Fatalf("node kinds wrong: %v", r.GetNodes())
	}
	if nodeOf(t, r, "root/m0").GetTokens() != 10 || nodeOf(t, r, "root/m1").GetTokens() != 5 || r.GetTokens() != 15 || r.GetTokensAfterCancel() != 0 {
		t.Fatalf("tokens: run %d (%d after cancel), m0 %d, m1 %d; want 15 = 10 + 5",
			r.GetTokens(), r.GetTokensAfterCancel(), nodeOf(t, r, "root/m0").GetTokens(), nodeOf(t, r, "root/m1").GetTokens())
	}

	// GetRun returns the finished run as summarized.
	got, err := e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: r.GetRunId()})
	if err != nil {
		t.Fatal(err)
	}
	if g := got.GetRun(); g.GetStatus() != r.GetStatus() || g.GetTokens() != 15 || len(g.GetNodes()) != 5 || !g.GetEndedAt().AsTime().Equal(r.GetEndedAt().AsTime()) {
		t.Fatalf("GetRun = %v, want the summary", g)
	}
}

func TestRunInvalidTask(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	for _, tc := range []struct {
		name, task string
		contains   []string
	}{
		{"empty", "", []string{"task is required"}},
		{"not a plan", "summarize the news", []string{"JSON plan"}},
		{"no steps", `{"steps":[]}`, []string{"steps"}},
		{"last step without answer", `{"steps":[{"think_tokens":3}]}`, []string{"steps[0].answer_tokens"}},
		{"bad json", `{"steps":`, []string{"plan"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st, err := e.orch.Run(context.Background(), &orchestratorv1.RunRequest{Task: tc.task})
			if err == nil {
				_, err = st.Recv()
			}
			meshtest.WantCode(t, err, codes.InvalidArgument, tc.contains...)
		})
	}
	resp, err := e.orch.ListRuns(context.Background(), &orchestratorv1.ListRunsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetRuns()) != 0 {
		t.Fatalf("refused runs were recorded: %v", resp.GetRuns())
	}
}

func TestRunClientDisconnectCancelsRun(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, &fakeModel{orphan: 2})
	rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: slowPlan})
	if e.waitDecoder(t) != "root/m0" {
		t.Fatal("first decoder is not root/m0")
	}
	time.Sleep(120 * time.Millisecond) // a few tokens
	cancelAt := time.Now()
	rs.cancel()
	if _, err := rs.rest(); status.Code(err) != codes.Canceled {
		t.Fatalf("Run after the client's cancel: %v", err)
	}
	r := e.waitEnded(t, started.GetRunId())
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT || r.GetErrorCode() != "CANCELLED" {
		t.Fatalf("run = %v, want CANCELLED by CLIENT_DISCONNECT", r)
	}
	ca := r.GetCancelledAt()
	if ca == nil || ca.AsTime().Before(cancelAt) || ca.AsTime().Sub(cancelAt) > time.Second {
		t.Fatalf("cancelled_at = %v, want just after the disconnect at %v", ca, cancelAt)
	}
	root := nodeOf(t, r, "root")
	if root.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || root.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("root = %v", root)
	}
	// The decoder was told first, by the broadcast, with the run's cause; the loop above
	// it waited for its own cancel rather than take the decoder's CANCELLED as a failure.
	m0 := nodeOf(t, r, "root/m0")
	if m0.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || m0.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("root/m0 = %v, want CANCELLED with the run's cause", m0)
	}
	// Tokens come from the decoder's own record, including the 2 it spent after the
	// cancel, which the orchestrator never received.
	if want := e.model.ledger.count(started.GetRunId(), "root/m0"); m0.GetTokens() != want || r.GetTokens() != want {
		t.Fatalf("tokens: run %d, root/m0 %d; the decoder recorded %d", r.GetTokens(), m0.GetTokens(), want)
	}
	if a := r.GetTokensAfterCancel(); a < 2 || a > 4 || a != m0.GetTokensAfterCancel() || m0.GetTokensAtCancel()+a != m0.GetTokens() {
		t.Fatalf("tokens after cancel: run %d, root/m0 %d of %d (%d at cancel); want the 2 orphans (at most a token or two more)",
			a, m0.GetTokensAfterCancel(), m0.GetTokens(), m0.GetTokensAtCancel())
	}
	if m0.GetTokensAtCancel() < 2 {
		t.Fatalf("root/m0 had %d tokens at the cancel, want the ones decoded before it", m0.GetTokensAtCancel())
	}
	if len(e.model.started) != 0 {
		t.Fatal("a decoder started after the run was cancelled")
	}
}

func TestRunContinueOnDisconnect(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	p := `{"tokens_per_second":100,"steps":[{"think_tokens":10,"tools":[{"name":"sleep","args":{"ms":100}}]},{"answer_tokens":5}]}`
	rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: p, ContinueOnDisconnect: true})
	rs.cancel()
	_, _ = rs.rest()
	r := e.waitEnded(t, started.GetRunId())
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || r.GetCancelledAt() != nil ||
		r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED || r.GetAnswer() == "" || r.GetTokens() != 15 {
		t.Fatalf("run = %v, want it to go on to success after the client left", r)
	}
}

// cancelLog wraps a NodeReportService client and records when its CancelNodes calls
// began and returned, and the settle timeout each asked for.
type cancelLog struct {
	meshv1.NodeReportServiceClient
	mu              sync.Mutex
	began, returned []time.Time
	settles         []time.Duration
}

func (c *cancelLog) CancelNodes(ctx context.Context, in *meshv1.CancelNodesRequest, opts ...grpc.CallOption) (*meshv1.CancelNodesResponse, error) {
	c.mu.Lock()
	c.began = append(c.began, time.Now())
	c.settles = append(c.settles, in.GetSettleTimeout().AsDuration())
	c.mu.Unlock()
	resp, err := c.NodeReportServiceClient.CancelNodes(ctx, in, opts...)
	c.mu.Lock()
	c.returned = append(c.returned, time.Now())
	c.mu.Unlock()
	return resp, err
}

func (c *cancelLog) times() (began, returned []time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.began), slices.Clone(c.returned)
}

// A cancel tells modelproxy (the first report) before the rest: toolrunner hears of it
// only once modelproxy has answered (asked to answer once its decoders have ended), or
// decoderWait after it was asked.
func TestCancelTellsDecodersFirst(t *testing.T) {
	var model, tools *cancelLog
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
		model = &cancelLog{NodeReportServiceClient: c.Reports[0]}
		tools = &cancelLog{NodeReportServiceClient: c.Reports[1]}
		c.Reports = []meshv1.NodeReportServiceClient{model, tools}
	})
	for _, how := range []string{"disconnect", "operator"} {
		rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: slowPlan})
		e.waitDecoder(t)
		cancelled := time.Now() // before the orchestrator's cancel, and so before its wait began
		if how == "disconnect" {
			rs.cancel()
		} else if _, err := e.orch.CancelRun(context.Background(), &orchestratorv1.CancelRunRequest{RunId: started.GetRunId()}); err != nil {
			t.Fatal(err)
		}
		r := e.waitEnded(t, started.GetRunId())
		want := meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT
		if how == "operator" {
			want = meshv1.CancelCause_CANCEL_CAUSE_OPERATOR
		}
		for _, n := range r.GetNodes() {
			if n.GetCause() != want {
				t.Errorf("%s: node %s ended with cause %v, want %v", how, n.GetId(), n.GetCause(), want)
			}
		}
		_, _ = rs.rest()
		mb, mr := model.times()
		tb, _ := tools.times()
		if len(mb) == 0 || len(tb) == 0 {
			t.Fatalf("%s: CancelNodes calls: modelproxy %d, toolrunner %d; want one each", how, len(mb), len(tb))
		}
		tl := tb[len(tb)-1]
		model.mu.Lock()
		ms := model.settles[len(model.settles)-1]
		model.mu.Unlock()
		tools.mu.Lock()
		ts := tools.settles[len(tools.settles)-1]
		tools.mu.Unlock()
		if ms != decoderWait || ts != 0 {
			t.Errorf("%s: settle timeouts asked: modelproxy %v, toolrunner %v; want %v and none", how, ms, ts, decoderWait)
		}
		answered := len(mr) == len(mb) && !tl.Before(mr[len(mr)-1])
		// The wait is bounded from when the orchestrator began it, which the test sees
		// only from outside: after the cancel, and before the call to modelproxy began
		// (a goroutine that may start late on a loaded machine).
		if !answered && (tl.Before(mb[len(mb)-1]) || tl.Sub(cancelled) < decoderWait) {
			t.Errorf("%s: toolrunner told %v after the cancel, %v after modelproxy was asked, before its answer and before decoderWait (%v)",
				how, tl.Sub(cancelled), tl.Sub(mb[len(mb)-1]), decoderWait)
		}
	}
}

func TestCancelRun(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: slowPlan})
	id := started.GetRunId()
	e.waitDecoder(t)
	rest := make(chan []*orchestratorv1.RunResponse, 1)
	restErr := make(chan error, 1)
	go func() {
		evs, err := rs.rest()
		rest <- evs
		restErr <- err
	}()

	// A running run reads its nodes live from the reports.
	time.Sleep(60 * time.Millisecond)
	live, err := e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	if lr := live.GetRun(); lr.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING || lr.GetEndedAt() != nil ||
		nodeOf(t, lr, "root/m0").GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING || nodeOf(t, lr, "root").GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING {
		t.Fatalf("live run = %v", lr)
	}

	cancelAt := time.Now()
	resp, err := e.orch.CancelRun(context.Background(), &orchestratorv1.CancelRunRequest{RunId: id, Reason: "test"})
	returned := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	r := resp.GetRun()
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Fatalf("CancelRun = %v, want CANCELLED by OPERATOR", r)
	}
	// It returned after the run ended and its tree was torn down.
	if r.GetEndedAt() == nil || r.GetEndedAt().AsTime().After(returned) || r.GetCancelledAt().AsTime().Before(cancelAt) {
		t.Fatalf("run ended at %v, cancelled at %v; CancelRun called at %v, returned at %v", r.GetEndedAt(), r.GetCancelledAt(), cancelAt, returned)
	}
	if m0 := nodeOf(t, r, "root/m0"); m0.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || m0.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Fatalf("root/m0 = %v, want ended with cause OPERATOR", m0)
	}

	// The Run stream ends with the summary and the run's status.
	evs := <-rest
	if err := <-restErr; status.Code(err) != codes.Canceled {
		t.Fatalf("Run stream ended with %v, want CANCELED", err)
	}
	if len(evs) == 0 || evs[len(evs)-1].GetFinished().GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Fatalf("Run stream's last event = %v, want the cancelled summary", evs)
	}

	// Cancelling an ended run returns it unchanged.
	again, err := e.orch.CancelRun(context.Background(), &orchestratorv1.CancelRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	if a := again.GetRun(); !a.GetEndedAt().AsTime().Equal(r.GetEndedAt().AsTime()) || a.GetCause() != r.GetCause() {
		t.Fatalf("second CancelRun = %v, want the run unchanged", a)
	}
	_, err = e.orch.CancelRun(context.Background(), &orchestratorv1.CancelRunRequest{RunId: "no-such-run"})
	meshtest.WantCode(t, err, codes.NotFound, "no-such-run")
	_, err = e.orch.CancelRun(context.Background(), &orchestratorv1.CancelRunRequest{})
	meshtest.WantCode(t, err, codes.InvalidArgument, "run_id")
}

func TestGetRunErrors(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	_, err := e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: "no-such-run"})
	meshtest.WantCode(t, err, codes.NotFound, "no-such-run")
	_, err = e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{})
	meshtest.WantCode(t, err, codes.InvalidArgument, "run_id")
}

func TestListRunsPaging(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	var ids []string // oldest first
	for i := 0; i < 3; i++ {
		rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: tinyPlan})
		if _, err := rs.rest(); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, started.GetRunId())
	}
	list := func(size int32, token string) *orchestratorv1.ListRunsResponse {
		t.Helper()
		resp, err := e.orch.ListRuns(context.Background(), &orchestratorv1.ListRunsRequest{PageSize: size, PageToken: token})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range resp.GetRuns() {
			if len(r.GetNodes()) != 0 {
				t.Fatalf("ListRuns returned nodes for run %s", r.GetRunId())
			}
		}
		return resp
	}
	runIDs := func(rs []*orchestratorv1.Run) string {
		var out []string
		for _, r := range rs {
			out = append(out, r.GetRunId())
		}
		return strings.Join(out, ",")
	}
	p1 := list(2, "")
	if runIDs(p1.GetRuns()) != ids[2]+","+ids[1] || p1.GetNextPageToken() == "" {
		t.Fatalf("page 1 = %s (next %q), want the two newest", runIDs(p1.GetRuns()), p1.GetNextPageToken())
	}
	p2 := list(2, p1.GetNextPageToken())
	if runIDs(p2.GetRuns()) != ids[0] || p2.GetNextPageToken() != "" {
		t.Fatalf("page 2 = %s (next %q), want the oldest and no next page", runIDs(p2.GetRuns()), p2.GetNextPageToken())
	}
	all := list(0, "")
	if runIDs(all.GetRuns()) != ids[2]+","+ids[1]+","+ids[0] || all.GetNextPageToken() != "" {
		t.Fatalf("default page = %s, want all three newest first", runIDs(all.GetRuns()))
	}
	if r := all.GetRuns()[0]; r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || r.GetTokens() != 1 {
		t.Fatalf("listed run = %v, want its summary", r)
	}
	// The run ids sort by creation (UUIDv7), like the list.
	if !sort.StringsAreSorted(ids) {
		t.Fatalf("run ids %v are not time-ordered", ids)
	}
	for _, tok := range []string{"abc", "-1", "1.5"} {
		_, err := e.orch.ListRuns(context.Background(), &orchestratorv1.ListRunsRequest{PageToken: tok})
		meshtest.WantCode(t, err, codes.InvalidArgument, "page_token")
	}
	_, err := e.orch.ListRuns(context.Background(), &orchestratorv1.ListRunsRequest{PageSize: -1})
	meshtest.WantCode(t, err, codes.InvalidArgument, "page_size")

	// Nothing in flight: Shutdown does not wait for its deadline.
	start := time.Now()
	e.srv.Shutdown(time.Now().Add(10 * time.Second))
	if d := time.Since(start); d > time.Second {
		t.Fatalf("Shutdown with no runs in flight took %v", d)
	}
}

func TestRunDeadlineCappedByPolicy(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{Deadline: deadline.Policy{Max: 2 * time.Second}}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Hour)
	defer cancel()
	before := time.Now()
	rs, started := e.start(ctx, t, &orchestratorv1.RunRequest{Task: tinyPlan})
	after := time.Now()
	dl := started.GetDeadline().AsTime()
	if dl.Before(before.Add(2*time.Second-50*time.Millisecond)) || dl.After(after.Add(2*time.Second)) {
		t.Fatalf("run deadline %v is %v from the call, want the policy's 2s max, not 10h", dl, dl.Sub(before))
	}
	evs, err := rs.rest()
	if err != nil {
		t.Fatal(err)
	}
	r := evs[len(evs)-1].GetFinished()
	if !r.GetDeadline().AsTime().Equal(dl) || nodeOf(t, r, "root").GetDeadline() == nil || !nodeOf(t, r, "root").GetDeadline().AsTime().Equal(dl) {
		t.Fatalf("summary deadline %v, root deadline %v; want the capped %v", r.GetDeadline(), nodeOf(t, r, "root").GetDeadline(), dl)
	}
}

func TestRunDeadlineExceeded(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{Deadline: deadline.Policy{Default: 500 * time.Millisecond, Max: 500 * time.Millisecond}}, nil)
	rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: slowPlan})
	if _, err := rs.rest(); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("Run: %v, want DEADLINE_EXCEEDED", err)
	}
	r := e.waitEnded(t, started.GetRunId())
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
		t.Fatalf("run = %v, want DEADLINE_EXCEEDED with cause DEADLINE", r)
	}
	if ca := r.GetCancelledAt(); ca == nil || ca.AsTime().After(r.GetDeadline().AsTime()) {
		t.Fatalf("cancelled_at %v, want set and not after the deadline %v", ca, r.GetDeadline())
	}
	if m0 := nodeOf(t, r, "root/m0"); m0.GetStatus() != meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED || m0.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
		t.Fatalf("root/m0 = %v, want DEADLINE_EXCEEDED with cause DEADLINE", m0)
	}
}

func TestShutdownCancelsLeftoverRuns(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: slowPlan, ContinueOnDisconnect: true})
	e.waitDecoder(t)
	rs.cancel() // the client leaves; the detached run goes on
	_, _ = rs.rest()
	time.Sleep(50 * time.Millisecond)
	if r, err := e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: started.GetRunId()}); err != nil || r.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
		t.Fatalf("detached run = %v, %v; want still running", r.GetRun(), err)
	}
	// The run goes on until the handover point, a fifth of the window before the
	// deadline, then is cancelled (no shared store to hand it over to); the teardown fits before
	// the deadline.
	start := time.Now()
	e.srv.Shutdown(start.Add(time.Second))
	if d := time.Since(start); d < 700*time.Millisecond || d > 3*time.Second {
		t.Fatalf("Shutdown took %v, want until its handover point (800ms) plus the teardown", d)
	}
	if r := e.waitEnded(t, started.GetRunId()); r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR || r.GetEndedAt() == nil {
		t.Fatalf("run after Shutdown = %v, want CANCELLED by OPERATOR", r)
	}
}

// A run is visible only to its tenant (the identity the server chain authenticated; here
// the chain honours curfew-tenant): another tenant cannot get, list, watch or cancel it,
// and is told NOT_FOUND, as for a run that does not exist.
func TestTenantIsolation(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	as := func(tenant string) context.Context {
		return metadata.AppendToOutgoingContext(context.Background(), md.Tenant, tenant)
	}
	rs, started := e.start(as("acme"), t, &orchestratorv1.RunRequest{Task: slowPlan})
	id := started.GetRunId()
	e.waitDecoder(t)

	other := as("globex")
	_, err := e.orch.GetRun(other, &orchestratorv1.GetRunRequest{RunId: id})
	meshtest.WantCode(t, err, codes.NotFound, id)
	_, err = e.orch.CancelRun(other, &orchestratorv1.CancelRunRequest{RunId: id})
	meshtest.WantCode(t, err, codes.NotFound, id)
	w, err := e.orch.WatchRun(other, &orchestratorv1.WatchRunRequest{RunId: id})
	if err == nil {
		_, err = w.Recv()
	}
	meshtest.WantCode(t, err, codes.NotFound, id)
	list, err := e.orch.ListRuns(other, &orchestratorv1.ListRunsRequest{})
	if err != nil || len(list.GetRuns()) != 0 {
		t.Fatalf("globex's ListRuns = %v, %v; want none of acme's runs", list.GetRuns(), err)
	}

	// acme's run went on, and acme sees and cancels it.
	got, err := e.orch.GetRun(as("acme"), &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil || got.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING || got.GetRun().GetTenant() != "acme" {
		t.Fatalf("acme's GetRun = %v, %v; want its run, still running", got.GetRun(), err)
	}
	if list, err := e.orch.ListRuns(as("acme"), &orchestratorv1.ListRunsRequest{}); err != nil || len(list.GetRuns()) != 1 {
		t.Fatalf("acme's ListRuns = %v, %v; want its one run", list.GetRuns(), err)
	}
	if _, err := e.orch.CancelRun(as("acme"), &orchestratorv1.CancelRunRequest{RunId: id}); err != nil {
		t.Fatal(err)
	}
	if _, err := rs.rest(); status.Code(err) != codes.Canceled {
		t.Fatalf("acme's Run stream ended with %v, want CANCELED by acme's own cancel", err)
	}
}
