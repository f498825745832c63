package toolrunner

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// streamed is an Execute stream's messages in the order they came: "node ID STATUS",
// "event ID PROGRESS/TOTAL" or "result".
type streamed struct {
	lines  []string
	events []*meshv1.NodeEvent
	err    error
}

func collect(resps []*toolrunnerv1.ExecuteResponse, err error) streamed {
	s := streamed{err: err}
	for _, r := range resps {
		switch e := r.GetEvent().(type) {
		case *toolrunnerv1.ExecuteResponse_Node:
			s.lines = append(s.lines, "node "+e.Node.GetId()+" "+strings.TrimPrefix(e.Node.GetStatus().String(), "NODE_STATUS_"))
		case *toolrunnerv1.ExecuteResponse_NodeEvent:
			p := e.NodeEvent.GetProgress()
			s.lines = append(s.lines, fmt.Sprintf("event %s %g/%g", e.NodeEvent.GetNodeId(), p.GetProgress(), p.GetTotal()))
			s.events = append(s.events, e.NodeEvent)
		case *toolrunnerv1.ExecuteResponse_Result:
			s.lines = append(s.lines, "result")
		}
	}
	return s
}

// inSpan fails the test unless every event happened while node ran.
func inSpan(t *testing.T, evs []*meshv1.NodeEvent, n *meshv1.Node) {
	t.Helper()
	for _, ev := range evs {
		at := ev.GetAt().AsTime()
		if ev.GetAt() == nil || at.Before(n.GetStartedAt().AsTime()) || at.After(n.GetEndedAt().AsTime()) {
			t.Fatalf("event %v at %v, outside its node's run %v..%v", ev, at, n.GetStartedAt().AsTime(), n.GetEndedAt().AsTime())
		}
	}
}

// A sleep with progress_ms reports at every multiple of it before its end, in order,
// each stamped while its node ran, and then its result.
func TestSleepReportsProgress(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	ctx, cancel := context.WithTimeout(ident("r-prog", "root/s0.t0"), 10*time.Second)
	defer cancel()
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "sleep", ArgsJson: `{"ms":250,"progress_ms":50}`})
	if err != nil {
		t.Fatal(err)
	}
	s := collect(meshtest.Drain(st))
	if s.err != nil {
		t.Fatal(s.err)
	}
	want := []string{
		"event root/s0.t0 50/250", "event root/s0.t0 100/250", "event root/s0.t0 150/250", "event root/s0.t0 200/250",
		"result",
	}
	if strings.Join(s.lines, "\n") != strings.Join(want, "\n") {
		t.Fatalf("stream:\n%s\nwant:\n%s", strings.Join(s.lines, "\n"), strings.Join(want, "\n"))
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-prog", "root/s0.t0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Fatalf("node = %v, want SUCCEEDED", n)
	}
	inSpan(t, s.events, n)
	for i := 1; i < len(s.events); i++ {
		if s.events[i].GetAt().AsTime().Before(s.events[i-1].GetAt().AsTime()) {
			t.Fatalf("event %d stamped before event %d: %v", i, i-1, s.events)
		}
	}
}

// A sleep cancelled mid-way (by the run's broadcast, so that its stream can still be
// read) stops reporting: every event it sent happened before its node ended.
func TestSleepProgressStopsAtCancel(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	ctx, cancel := context.WithTimeout(ident("r-progc", "root/s0.t0"), 10*time.Second)
	defer cancel()
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "sleep", ArgsJson: `{"ms":60000,"progress_ms":20}`})
	if err != nil {
		t.Fatal(err)
	}
	var resps []*toolrunnerv1.ExecuteResponse
	for len(resps) < 2 { // two reports: the tool is well under way
		r, err := st.Recv()
		if err != nil {
			t.Fatalf("before the cancel: %v", err)
		}
		resps = append(resps, r)
	}
	if _, err := e.srv.Report().CancelNodes(context.Background(), &meshv1.CancelNodesRequest{RunId: "r-progc",
		NodePrefixes: []string{"root/s0.t0"}, Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR}); err != nil {
		t.Fatal(err)
	}
	rest, err := meshtest.Drain(st)
	s := collect(append(resps, rest...), err)
	if status.Code(s.err) != codes.Canceled {
		t.Fatalf("after the cancel: %v, want CANCELED", s.err)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-progc", "root/s0.t0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED {
		t.Fatalf("node = %v, want CANCELLED", n)
	}
	inSpan(t, s.events, n)
	for i, ev := range s.events {
		if got, want := ev.GetProgress().GetProgress(), float64(20*(i+1)); got != want {
			t.Fatalf("report %d = %v, want %v (every progress_ms, in order): %v", i, got, want, s.lines)
		}
	}
}

// recordingStream is the sending side of an Execute stream, recording what it sends.
type recordingStream struct {
	toolrunnerv1.ToolRunnerService_ExecuteServer
	sent []*toolrunnerv1.ExecuteResponse
}

func (r *recordingStream) Send(m *toolrunnerv1.ExecuteResponse) error {
	r.sent = append(r.sent, m)
	return nil
}

// An event sent after the node ended is dropped; one without a node or a time gets the
// tool's node and now.
func TestEventsAfterEndDropped(t *testing.T) {
	var mu sync.Mutex
	rs := &recordingStream{}
	evs := &events{mu: &mu, stream: rs, node: "root/s0.t0"}
	before := time.Now()
	evs.send(progress(1, 2, "half"))
	evs.send(&meshv1.NodeEvent{NodeId: "root/s0.t0/sub/s0.t0", Kind: &meshv1.NodeEvent_Progress{Progress: &meshv1.Progress{Progress: 3}}})
	evs.end()
	evs.send(progress(2, 2, "late"))
	if len(rs.sent) != 2 {
		t.Fatalf("sent %v, want the two events before the end only", rs.sent)
	}
	own, nested := rs.sent[0].GetNodeEvent(), rs.sent[1].GetNodeEvent()
	if own.GetNodeId() != "root/s0.t0" || own.GetAt().AsTime().Before(before) || own.GetProgress().GetMessage() != "half" {
		t.Fatalf("own event = %v, want the tool's node, stamped now", own)
	}
	if nested.GetNodeId() != "root/s0.t0/sub/s0.t0" {
		t.Fatalf("nested event = %v, want its own node kept", nested)
	}
}

// spawn_subagent forwards the subagent's node events in the order they came, among its
// nodes.
func TestSpawnSubagentForwardsNodeEvents(t *testing.T) {
	f := &fakeSubagent{progress: []float64{10, 20}}
	e := newSubagentEnv(t, f, Config{})
	ctx, cancel := context.WithTimeout(ident("r-spawnev", "root/s0.t1"), 5*time.Second)
	defer cancel()
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "spawn_subagent", ArgsJson: spawnArgs})
	if err != nil {
		t.Fatal(err)
	}
	s := collect(meshtest.Drain(st))
	if s.err != nil {
		t.Fatal(s.err)
	}
	want := []string{
		"node root/s0.t1/sub RUNNING",
		"node root/s0.t1/sub/m0 RUNNING",
		"event root/s0.t1/sub/m0 10/0",
		"event root/s0.t1/sub/m0 20/0",
		"node root/s0.t1/sub/m0 SUCCEEDED",
		"node root/s0.t1/sub SUCCEEDED",
		"result",
	}
	if strings.Join(s.lines, "\n") != strings.Join(want, "\n") {
		t.Fatalf("stream:\n%s\nwant:\n%s", strings.Join(s.lines, "\n"), strings.Join(want, "\n"))
	}
	<-f.entered
}

// sendProgress sends the fake subagent's scripted progress events for node.
func (f *fakeSubagent) sendProgress(stream subagentv1.SubagentService_SpawnServer, node string) {
	for _, p := range f.progress {
		ev := progress(p, 0, "")
		ev.NodeId = node
		_ = stream.Send(&subagentv1.SpawnResponse{Event: &subagentv1.SpawnResponse_NodeEvent{NodeEvent: ev}})
	}
}
