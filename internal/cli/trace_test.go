package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// traceRun is a run cancelled 1 s after its start with a 4 s deadline: a decoder that
// stopped 5 ms after the cancel, with one token after it, a tool retried once that ended
// before the cancel, and a subagent still running.
func traceRun() *orchestratorv1.Run {
	t0 := time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC)
	at := func(ms int) *timestamppb.Timestamp {
		return timestamppb.New(t0.Add(time.Duration(ms) * time.Millisecond))
	}
	return &orchestratorv1.Run{RunId: "r1", Status: orchestratorv1.RunStatus_RUN_STATUS_CANCELLED,
		Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR, CreatedAt: at(0), Deadline: at(4000), CancelledAt: at(1000), EndedAt: at(1020),
		Tokens: 41, TokensAfterCancel: 1, PromptTokens: 12,
		Nodes: []*meshv1.Node{
			{Id: "root", Kind: meshv1.NodeKind_NODE_KIND_RUN, Name: "run", Status: meshv1.NodeStatus_NODE_STATUS_CANCELLED,
				Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR, StartedAt: at(0), EndedAt: at(1010), Deadline: at(4000)},
			{Id: "root/m0", Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: "sim", Status: meshv1.NodeStatus_NODE_STATUS_CANCELLED,
				Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR, StartedAt: at(10), EndedAt: at(1005), CancelledAt: at(1005), Deadline: at(4000),
				Tokens: 41, TokensAtCancel: 40, TokensAfterCancel: 1, PromptTokens: 12},
			{Id: "root/s0.t0", Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: "fail", Status: meshv1.NodeStatus_NODE_STATUS_SUCCEEDED,
				StartedAt: at(200), EndedAt: at(400), Deadline: at(4000), EarlierAttempts: []*meshv1.AttemptRecord{{Attempt: 1}}},
			{Id: "root/s0.t1/sub", Kind: meshv1.NodeKind_NODE_KIND_SUBAGENT, Name: "subagent", Status: meshv1.NodeStatus_NODE_STATUS_RUNNING,
				StartedAt: at(300)},
		}}
}

func TestNewTimeline(t *testing.T) {
	tl := NewTimeline(traceRun())
	if tl.RunID != "r1" || tl.Status != "cancelled" || tl.Cause != "operator" || *tl.CancelMS != 1000 || *tl.DeadlineMS != 4000 ||
		*tl.EndedMS != 1020 || tl.StartedAt != "2026-12-01T10:00:00Z" || tl.Tokens != 41 || tl.TokensAfterCancel != 1 || tl.PromptTokens != 12 || tl.Nodes[1].PromptTokens != 12 {
		t.Fatalf("run figures: %+v", tl)
	}
	if len(tl.Nodes) != 4 {
		t.Fatalf("%d nodes, want 4", len(tl.Nodes))
	}
	m0 := tl.Nodes[1]
	if m0.ID != "root/m0" || m0.Depth != 1 || m0.Kind != "model" || m0.Cause != "operator" || *m0.StartMS != 10 || *m0.EndMS != 1005 ||
		*m0.EndAfterCancelMS != 5 || *m0.CancelledMS != 1005 || *m0.LeftMS != 2995 || m0.TokensAfterCancel != 1 || m0.Attempts != 1 {
		t.Errorf("root/m0: %+v", m0)
	}
	tool := tl.Nodes[2]
	if *tool.EndAfterCancelMS != -600 || tool.Attempts != 2 || tool.Cause != "" {
		t.Errorf("root/s0.t0: %+v", tool)
	}
	sub := tl.Nodes[3]
	if sub.EndMS != nil || sub.EndAfterCancelMS != nil || sub.LeftMS != nil || sub.DeadlineMS != nil || sub.Depth != 2 {
		t.Errorf("a running node has no end: %+v", sub)
	}
	// JSON: the figures under their documented names; unknown instants are absent.
	b, err := json.Marshal(tl)
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		CancelMS float64          `json:"cancel_ms"`
		Nodes    []map[string]any `json:"nodes"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatal(err)
	}
	if v.CancelMS != 1000 || v.Nodes[1]["end_after_cancel_ms"] != 5.0 || v.Nodes[1]["tokens_after_cancel"] != 1.0 {
		t.Errorf("JSON: %s", b)
	}
	if _, ok := v.Nodes[3]["end_ms"]; ok {
		t.Errorf("a running node's end_ms must be absent: %s", b)
	}
}

func TestPrintTimeline(t *testing.T) {
	var b bytes.Buffer
	printTimeline(&b, NewTimeline(traceRun()), 41)
	out := b.String()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	for _, want := range []string{"run r1  cancelled (cause operator)", "deadline +4000ms   cancel +1000ms   tokens 41   tokens after cancel 1   prompt tokens 12",
		"AFTER_CANCEL", "0 .. 4000ms"} {
		if !strings.Contains(out, want) {
			t.Errorf("timeline lacks %q:\n%s", want, out)
		}
	}
	if len(lines) != 3+4 {
		t.Fatalf("%d lines, want 3 header lines and 4 nodes:\n%s", len(lines), out)
	}
	// The axis is 0..4000 ms over 41 columns: 100 ms a column. The cancel is column 10,
	// the deadline column 40.
	axis := strings.Index(lines[2], "0 .. ")
	bar := func(line string) string { return line[axis:] }
	m0 := lines[4]
	if !strings.HasPrefix(m0, "  m0 ") || !strings.Contains(m0, "cancelled/operator") || !strings.Contains(m0, "+5ms") || !strings.Contains(m0, "+2995ms") {
		t.Errorf("root/m0 row: %q", m0)
	}
	if got := bar(m0); got != "==========:"+strings.Repeat(" ", 29)+"D" {
		t.Errorf("root/m0 bar %q: from column 0 to 10, the cancel column covered", got)
	}
	if got := bar(lines[5]); got != "  ===     |"+strings.Repeat(" ", 29)+"D" {
		t.Errorf("root/s0.t0 bar %q: columns 2 to 4, the cancel after it", got)
	}
	if got := bar(lines[6]); got != "   =======:"+strings.Repeat("=", 30) {
		t.Errorf("a running node's bar runs to the axis's end: %q", got)
	}
}

func TestTraceUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"trace"}, "give one RUN id"},
		{[]string{"trace", "a", "b"}, "give one RUN id"},
		{[]string{"trace", "a", "--width", "3"}, "--width"},
	} {
		var out, errb bytes.Buffer
		if code := Main(context.Background(), tc.args, nil, &out, &errb); code != ExitUsage || !strings.Contains(errb.String(), tc.want) {
			t.Errorf("%q: exit %d %q, want %d and %q", tc.args, code, errb.String(), ExitUsage, tc.want)
		}
	}
}
