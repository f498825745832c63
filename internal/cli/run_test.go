package cli

import (
	"bytes"
	"strings"
	"testing"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// The live tree shows a running node's latest progress, and none once it ended.
func TestLiveTreeShowsProgress(t *testing.T) {
	var out bytes.Buffer
	v := newView(&out, false)
	tool := &meshv1.Node{Id: "root/s0.t0", Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: "sleep", Status: meshv1.NodeStatus_NODE_STATUS_RUNNING}
	v.node(nil, tool)
	progress := func(p, total float64, msg string) {
		v.event(nil, &meshv1.NodeEvent{NodeId: "root/s0.t0", Kind: &meshv1.NodeEvent_Progress{Progress: &meshv1.Progress{Progress: p, Total: total, Message: msg}}})
	}
	line := func() string {
		out.Reset()
		v.redraw()
		for _, l := range strings.Split(out.String(), "\n") {
			if strings.Contains(l, "s0.t0") {
				return l
			}
		}
		t.Fatalf("no line for the tool in %q", out.String())
		return ""
	}
	progress(1000, 10000, "")
	progress(4299, 10000, "copying\x1b[2J files\n")
	if l := line(); !strings.HasSuffix(l, "running    42% 4299/10000 copying [2J files") {
		t.Fatalf("line = %q, want the latest progress, its message on one line without control characters", l)
	}
	progress(7, 0, "")
	if l := line(); !strings.HasSuffix(l, "running    7") {
		t.Fatalf("line = %q, want the progress without a total", l)
	}
	progress(1, 0, strings.Repeat("x", 100))
	if l := line(); !strings.HasSuffix(l, " 1 "+strings.Repeat("x", maxProgressMessage-1)+"…") {
		t.Fatalf("line = %q, want the message cut", l)
	}
	ended := &meshv1.Node{Id: "root/s0.t0", Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: "sleep", Status: meshv1.NodeStatus_NODE_STATUS_SUCCEEDED}
	v.node(nil, ended)
	progress(9999, 10000, "late")
	if l := line(); strings.Contains(l, "%") || strings.Contains(l, "late") || strings.Contains(l, " 1 ") {
		t.Fatalf("line = %q, want no progress on an ended node", l)
	}
}

// --json prints every node event as a line of its own.
func TestJSONViewPrintsNodeEvents(t *testing.T) {
	var out bytes.Buffer
	v := newView(&out, true)
	ev := &meshv1.NodeEvent{NodeId: "root/s0.t0", Kind: &meshv1.NodeEvent_Progress{Progress: &meshv1.Progress{Progress: 1, Total: 2}}}
	v.event(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_NodeEvent{NodeEvent: ev}}, ev)
	if s := out.String(); !strings.Contains(s, `"node_event"`) || !strings.Contains(s, `"progress"`) || strings.Count(s, "\n") != 1 {
		t.Fatalf("printed %q, want one JSON line with the node event", s)
	}
}
