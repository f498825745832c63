package orchestrator

import (
	"context"
	"sync"
	"testing"

	"google.golang.org/grpc"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
)

// listLog is a node report that counts the ListNodes calls it was asked, per run.
type listLog struct {
	meshv1.NodeReportServiceClient
	mu    sync.Mutex
	lists map[string]int
}

func (l *listLog) ListNodes(ctx context.Context, in *meshv1.ListNodesRequest, opts ...grpc.CallOption) (*meshv1.ListNodesResponse, error) {
	l.mu.Lock()
	l.lists[in.GetRunId()]++
	l.mu.Unlock()
	return l.NodeReportServiceClient.ListNodes(ctx, in, opts...)
}

func (l *listLog) asked(run string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lists[run]
}

// A run's summary asks only the executors its nodes reached: toolrunner only for a run
// that called a tool; a run that called one gets its tool nodes from toolrunner's record.
func TestSummaryAsksOnlyTheExecutorsTheRunReached(t *testing.T) {
	var model, tools *listLog
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
		model = &listLog{NodeReportServiceClient: c.Reports[0], lists: map[string]int{}}
		tools = &listLog{NodeReportServiceClient: c.Reports[1], lists: map[string]int{}}
		c.Reports = []meshv1.NodeReportServiceClient{model, tools}
	})
	for _, tc := range []struct {
		plan      string
		wantTools int
	}{
		{`{"steps": [{"answer_tokens": 3}]}`, 0},
		{fastPlan, 1},
	} {
		rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: tc.plan})
		if _, err := rs.rest(); err != nil {
			t.Fatalf("%s: %v", tc.plan, err)
		}
		r := e.waitEnded(t, started.GetRunId())
		id := started.GetRunId()
		if model.asked(id) != 1 || tools.asked(id) != tc.wantTools {
			t.Errorf("%s: modelproxy asked %d times, toolrunner %d; want 1 and %d", tc.plan, model.asked(id), tools.asked(id), tc.wantTools)
		}
		var toolNodes int
		for _, n := range r.GetNodes() {
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL {
				toolNodes++
				if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetEndedAt() == nil {
					t.Errorf("%s: tool node %v, want toolrunner's record of its success", tc.plan, n)
				}
			}
		}
		if toolNodes != 2*tc.wantTools {
			t.Errorf("%s: %d tool nodes in the summary, want %d", tc.plan, toolNodes, 2*tc.wantTools)
		}
	}
}

// reachedBy: a tool reaches toolrunner; a subagent, every executor.
func TestReachedBy(t *testing.T) {
	for _, tc := range []struct {
		n    *meshv1.Node
		want reportSet
	}{
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_MODEL}, 0},
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_RUN}, 0},
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: "sleep"}, 1 << reportTool},
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: "spawn_subagent"}, allReports},
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_SUBAGENT}, allReports},
	} {
		if got := reachedBy(tc.n); got != tc.want {
			t.Errorf("reachedBy(%v) = %b, want %b", tc.n, got, tc.want)
		}
	}
}

// A client that asked for the summary alone, and so is sent nothing while the run goes
// on, still cancels the run by leaving.
func TestSummaryOnlyClientDisconnectCancelsRun(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	rs, started := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: slowPlan, Events: orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY})
	e.waitDecoder(t)
	rs.cancel()
	r := e.waitEnded(t, started.GetRunId())
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("run = %v %v, want CANCELLED by CLIENT_DISCONNECT", r.GetStatus(), r.GetCause())
	}
}
