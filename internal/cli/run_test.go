package cli

import (
	"bytes"
	"fmt"
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

func textEvent(id string, offset int, text string) *meshv1.NodeEvent {
	return &meshv1.NodeEvent{NodeId: id, Kind: &meshv1.NodeEvent_Text{Text: &meshv1.TextDelta{Text: text, Offset: int64(offset)}}}
}

// On a terminal the live tree paints, under the tree, the last lines of the text of the
// root's latest model node, none of them wider than the terminal and without control
// characters; a subagent's text is not shown, nor text after its node ended.
func TestLiveTreeShowsTheAnswerAsItStreams(t *testing.T) {
	var out bytes.Buffer
	v := newView(&out, false)
	v.live, v.width = true, 20
	model := func(id string, st meshv1.NodeStatus) *meshv1.Node {
		return &meshv1.Node{Id: id, Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: "sim", Status: st}
	}
	v.node(nil, model("root/m0", meshv1.NodeStatus_NODE_STATUS_RUNNING))
	v.event(nil, textEvent("root/m0", 0, "thinking"))
	v.node(nil, model("root/m0", meshv1.NodeStatus_NODE_STATUS_SUCCEEDED))
	v.event(nil, textEvent("root/m0", 8, " late"))
	v.node(nil, model("root/s0.t0/sub/m0", meshv1.NodeStatus_NODE_STATUS_RUNNING))
	v.event(nil, textEvent("root/s0.t0/sub/m0", 0, "nested"))
	v.node(nil, model("root/m1", meshv1.NodeStatus_NODE_STATUS_RUNNING))
	answer := "line one\n\x1b[2Jsecond line that is long\n"
	for i := 1; i < 12; i++ {
		answer += fmt.Sprintf("l%d\n", i)
	}
	for off := 0; off < len(answer); off += 5 {
		v.event(nil, textEvent("root/m1", off, answer[off:min(off+5, len(answer))]))
	}
	out.Reset()
	v.redraw()
	s := out.String()
	if strings.Contains(s, "nested") || strings.Contains(s, "thinking") || strings.Contains(s, "late") || strings.Contains(s, "\x1b[2J") {
		t.Fatalf("painted %q: want only root/m1's text, without control characters", s)
	}
	_, text, ok := strings.Cut(s, "root/m1:\n")
	if !ok {
		t.Fatalf("painted %q, want root/m1's text under the tree", s)
	}
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	if len(lines) != maxTextLines || lines[len(lines)-2] != "  l11" || lines[len(lines)-1] != "  " {
		t.Fatalf("text lines %q, want the last %d, ending with l11", lines, maxTextLines)
	}
	for _, l := range lines {
		if n := len([]rune(l)); n >= v.width {
			t.Fatalf("line %q is %d wide on a %d-column terminal: it would wrap", l, n, v.width)
		}
	}
	if v.lines != strings.Count(s, "\n") {
		t.Fatalf("counted %d lines to repaint, painted %d", v.lines, strings.Count(s, "\n"))
	}
}

// Not on a terminal, the root's model text is written as it arrives, on a line of its
// node's own that ends with the node, before the summary; a delta seen already is not
// written twice and lost deltas show as "…". Nothing is repainted.
func TestPlainOutputStreamsTheAnswer(t *testing.T) {
	var out bytes.Buffer
	v := newView(&out, false)
	model := func(id string, st meshv1.NodeStatus) *meshv1.Node {
		return &meshv1.Node{Id: id, Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: "sim", Status: st}
	}
	v.node(nil, model("root/m0", meshv1.NodeStatus_NODE_STATUS_RUNNING))
	v.event(nil, textEvent("root/m0", 0, "let me "))
	v.event(nil, textEvent("root/m0", 4, "me see")) // overlaps what was seen
	v.event(nil, textEvent("root/m0", 20, " more")) // after lost deltas
	v.node(nil, model("root/m0", meshv1.NodeStatus_NODE_STATUS_SUCCEEDED))
	v.node(nil, model("root/m1", meshv1.NodeStatus_NODE_STATUS_RUNNING))
	v.event(nil, textEvent("root/m1", 0, "forty"))
	v.event(nil, textEvent("root/m1", 5, " two"))
	v.finished(nil, &orchestratorv1.Run{RunId: "r1", Status: orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED, Answer: "forty two"})
	want := "root/m0: let me see… more\nroot/m1: forty two\nrun r1  succeeded\n"
	if s := out.String(); !strings.HasPrefix(s, want) || strings.Contains(s, "\x1b") {
		t.Fatalf("printed %q, want it to start %q, without escapes", s, want)
	}
}

// --json prints every text delta as an event line of its own.
func TestJSONViewPrintsTextDeltas(t *testing.T) {
	var out bytes.Buffer
	v := newView(&out, true)
	for i, s := range []string{"a", "b"} {
		ev := textEvent("root/m0", i, s)
		v.event(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_NodeEvent{NodeEvent: ev}}, ev)
	}
	if s := out.String(); strings.Count(s, `"text":{`) != 2 || strings.Count(s, "\n") != 2 {
		t.Fatalf("printed %q, want two JSON lines with a text delta each", s)
	}
}
