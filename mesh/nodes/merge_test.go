package nodes_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

func node(id string, kind meshv1.NodeKind, st meshv1.NodeStatus, cause meshv1.CancelCause) *meshv1.Node {
	return &meshv1.Node{Id: id, Kind: kind, Status: st, Cause: cause}
}

func note(id string, cause meshv1.CancelCause, at time.Time) *meshv1.Node {
	return &meshv1.Node{Id: id, Cause: cause, CancelledAt: timestamppb.New(at)}
}

func byID(ns []*meshv1.Node) map[string]*meshv1.Node {
	m := map[string]*meshv1.Node{}
	for _, n := range ns {
		m[n.Id] = n
	}
	return m
}

func TestMerge(t *testing.T) {
	const (
		run   = meshv1.NodeKind_NODE_KIND_RUN
		model = meshv1.NodeKind_NODE_KIND_MODEL
		sub   = meshv1.NodeKind_NODE_KIND_SUBAGENT
	)
	noteAt := time.Unix(1700000000, 0)
	// The orchestrator records the run, the model nodes (as the loop saw them) and notes
	// for the siblings it cancelled.
	orchestrator := []*meshv1.Node{
		node("root", run, failed, noCause),
		node("root/m0", model, succeeded, noCause),
		note("root/s0.t0", sibling, noteAt),
		note("root/s0.t2", sibling, noteAt),
		note("root/s0.t3", sibling, noteAt), // t3 finished before the cancel
	}
	// toolrunner records the tools; it saw RST_STREAM only, so no cause.
	toolrunner := []*meshv1.Node{
		node("root/s0.t3", tool, succeeded, noCause),
		node("root/s0.t2", tool, cancelled, noCause),
		node("root/s0.t1", tool, failed, noCause),
		node("root/s0.t0", tool, cancelled, noCause),
		{Id: "root/s0.t0", Kind: tool, Status: succeeded, Name: "second report loses"},
	}
	// subagent ran a nested loop under t2; its model node was cancelled with it.
	subagent := []*meshv1.Node{
		node("root/s0.t2/sub", sub, cancelled, noCause),
		node("root/s0.t2/sub/m0", model, cancelled, noCause),
		node("root/s0.t2/sub/m1", model, cancelled, operator), // knows its own cause
	}
	in := [][]*meshv1.Node{orchestrator, toolrunner, subagent}
	snapshot := make([][]*meshv1.Node, len(in))
	for i, rep := range in {
		for _, n := range rep {
			snapshot[i] = append(snapshot[i], proto.Clone(n).(*meshv1.Node))
		}
	}

	out := nodes.Merge(in...)

	want := []string{"root", "root/m0", "root/s0.t0", "root/s0.t1", "root/s0.t2", "root/s0.t2/sub", "root/s0.t2/sub/m0", "root/s0.t2/sub/m1", "root/s0.t3"}
	if got := ids(out); !slices.Equal(got, want) {
		t.Fatalf("merged ids = %q, want %q (root first, sorted, notes folded in)", got, want)
	}
	m := byID(out)
	check := func(id string, st meshv1.NodeStatus, cause meshv1.CancelCause) {
		t.Helper()
		if n := m[id]; n.Status != st || n.Cause != cause {
			t.Errorf("%s = %v/%v, want %v/%v", id, n.Status, n.Cause, st, cause)
		}
	}
	check("root", failed, noCause)
	check("root/m0", succeeded, noCause)
	check("root/s0.t0", cancelled, sibling) // the first (executor) record wins, the note gives the cause
	check("root/s0.t1", failed, noCause)
	check("root/s0.t2", cancelled, sibling)
	check("root/s0.t2/sub", cancelled, sibling)    // inherited from the nearest ancestor
	check("root/s0.t2/sub/m0", cancelled, sibling) // through two levels
	check("root/s0.t2/sub/m1", cancelled, operator)
	check("root/s0.t3", succeeded, noCause) // succeeded: the note does not apply
	if m["root/s0.t0"].Name == "second report loses" {
		t.Error("a later report replaced the first executor record")
	}
	if got := m["root/s0.t0"].CancelledAt; got == nil || !got.AsTime().Equal(noteAt) {
		t.Errorf("cancelled_at of root/s0.t0 = %v, want the note's %v", got, noteAt)
	}
	if got := m["root/s0.t2/sub"].CancelledAt; got == nil || !got.AsTime().Equal(noteAt) {
		t.Errorf("cancelled_at of root/s0.t2/sub = %v, want the ancestor note's %v", got, noteAt)
	}
	for i, rep := range in {
		for j, n := range rep {
			if !proto.Equal(n, snapshot[i][j]) {
				t.Errorf("Merge modified its input %s: %v", n.Id, n)
			}
		}
	}
}

func TestMergeDeadlineCause(t *testing.T) {
	at := time.Now()
	out := nodes.Merge(
		[]*meshv1.Node{
			node("root", meshv1.NodeKind_NODE_KIND_RUN, deadlined, deadline),
			node("root/s0.t0", tool, cancelled, noCause),                    // saw RST_STREAM a moment first
			node("root/s0.t1", tool, succeeded, noCause),                    // finished in time
			node("root/s0.t2", tool, failed, noCause),                       // failed on its own
			node("root/s0.t3", tool, cancelled, sibling),                    // keeps its own cause
			{Id: "root/s0.t4", Kind: tool, Status: cancelled, Tokens: 3},    // covered by a note
			node("root/s0.t4/x", tool, deadlined, noCause),                  // nearest is the note, not root
			node("root/s0.t5", tool, running, noCause),                      // still running
			{Id: "root/s0.t4/y", Kind: tool, Status: cancelled, Tokens: 1},  // via the note too
			{Id: "orphan/x", Kind: tool, Status: cancelled, ErrorCode: "X"}, // no ancestor knows
		},
		[]*meshv1.Node{note("root/s0.t4", operator, at)},
	)
	m := byID(out)
	for id, want := range map[string]struct {
		st    meshv1.NodeStatus
		cause meshv1.CancelCause
	}{
		"root/s0.t0":   {deadlined, deadline},
		"root/s0.t1":   {succeeded, noCause},
		"root/s0.t2":   {failed, noCause},
		"root/s0.t3":   {cancelled, sibling},
		"root/s0.t4":   {cancelled, operator},
		"root/s0.t4/x": {deadlined, operator},
		"root/s0.t4/y": {cancelled, operator},
		"root/s0.t5":   {running, noCause},
		"orphan/x":     {cancelled, noCause},
	} {
		if n := m[id]; n == nil || n.Status != want.st || n.Cause != want.cause {
			t.Errorf("%s = %v, want %v/%v", id, n, want.st, want.cause)
		}
	}
	if out[0].Id != "orphan/x" || out[1].Id != "root" {
		t.Errorf("order = %q, want sorted by path", ids(out))
	}
}

func TestMergeNotesOnly(t *testing.T) {
	if out := nodes.Merge([]*meshv1.Node{note("root/s0.t0", sibling, time.Now())}); len(out) != 0 {
		t.Errorf("a note without an executor record must not become a node: %v", out)
	}
	if out := nodes.Merge(); len(out) != 0 {
		t.Errorf("Merge() = %v", out)
	}
}

func TestOutcomeOf(t *testing.T) {
	live := context.Background()
	sib, stopSib := context.WithCancelCause(live)
	stopSib(cancel.ErrSiblingFailed)
	plain, stopPlain := context.WithCancel(live)
	stopPlain()
	expired, stopExp := context.WithDeadline(live, time.Now().Add(-time.Second))
	defer stopExp()
	runDeadline, stopRD := context.WithCancelCause(live)
	stopRD(cancel.ErrDeadline)

	cases := []struct {
		name string
		ctx  context.Context
		err  error
		want nodes.Outcome
	}{
		{"success", live, nil, nodes.Outcome{Status: succeeded}},
		{"failure", live, status.Error(codes.Unavailable, "down"), nodes.Outcome{Status: failed, Code: "UNAVAILABLE", Message: "down"}},
		{"sibling cancel wins over err", sib, errors.New("io"), nodes.Outcome{Status: cancelled, Cause: sibling, Code: "CANCELLED", Message: "a sibling failed"}},
		{"upstream cancel", plain, nil, nodes.Outcome{Status: cancelled, Cause: noCause, Code: "CANCELLED", Message: "cancelled"}},
		{"deadline", expired, nil, nodes.Outcome{Status: deadlined, Cause: deadline, Code: "DEADLINE_EXCEEDED", Message: "deadline exceeded"}},
		{"run deadline cause", runDeadline, nil, nodes.Outcome{Status: deadlined, Cause: deadline, Code: "DEADLINE_EXCEEDED", Message: "run deadline exceeded"}},
	}
	for _, tc := range cases {
		if got := nodes.OutcomeOf(tc.ctx, tc.err); got != tc.want {
			t.Errorf("%s: OutcomeOf = %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

func TestErrOutcome(t *testing.T) {
	cases := []struct {
		err  error
		want nodes.Outcome
	}{
		{nil, nodes.Outcome{Status: succeeded}},
		{status.Error(codes.Canceled, "cancelled: x"), nodes.Outcome{Status: cancelled, Code: "CANCELLED", Message: "cancelled: x"}},
		{status.Error(codes.DeadlineExceeded, "no time left"), nodes.Outcome{Status: deadlined, Code: "DEADLINE_EXCEEDED", Message: "no time left"}},
		{status.Error(codes.ResourceExhausted, "budget"), nodes.Outcome{Status: failed, Code: "RESOURCE_EXHAUSTED", Message: "budget"}},
		{errors.New("plain"), nodes.Outcome{Status: failed, Code: "UNKNOWN", Message: "plain"}},
		{fmt.Errorf("wrapped: %w", status.Error(codes.NotFound, "gone")), nodes.Outcome{Status: failed, Code: "NOT_FOUND", Message: "wrapped: rpc error: code = NotFound desc = gone"}},
	}
	for _, tc := range cases {
		if got := nodes.ErrOutcome(tc.err); got != tc.want {
			t.Errorf("ErrOutcome(%v) = %+v, want %+v", tc.err, got, tc.want)
		}
	}
}

func TestCodeName(t *testing.T) {
	for c, want := range map[codes.Code]string{
		codes.OK: "OK", codes.Canceled: "CANCELLED", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
		codes.Unavailable: "UNAVAILABLE", codes.ResourceExhausted: "RESOURCE_EXHAUSTED", codes.Code(99): "Code(99)",
	} {
		if got := nodes.CodeName(c); got != want {
			t.Errorf("CodeName(%d) = %q, want %q", c, got, want)
		}
	}
	// Every code a status can carry has its canonical name, the one gRPC parses back.
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		var back codes.Code
		if err := back.UnmarshalJSON([]byte(`"` + nodes.CodeName(c) + `"`)); err != nil || back != c {
			t.Errorf("CodeName(%v) = %q does not parse back: %v, %v", c, nodes.CodeName(c), back, err)
		}
	}
}

func TestFinish(t *testing.T) {
	tb := nodes.New(0)
	tb.Start("r", &meshv1.Node{Id: "root/s0.t0", Kind: tool})
	ctx, stop := context.WithCancelCause(context.Background())
	stop(cancel.ErrOperator)
	n := tb.Finish(ctx, "r", "root/s0.t0", nil, func(n *meshv1.Node) { n.Tokens = 5 })
	if n.Status != cancelled || n.Cause != operator || n.ErrorCode != "CANCELLED" || n.Tokens != 5 || n.EndedAt == nil {
		t.Errorf("Finish = %v", n)
	}
}

// Tokens after the cancel beyond one per decoder are orphans; other kinds have none.
func TestOrphanTokens(t *testing.T) {
	for _, c := range []struct {
		n    *meshv1.Node
		want int64
	}{
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_MODEL}, 0},
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_MODEL, TokensAfterCancel: 1}, 0},
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_MODEL, TokensAfterCancel: 40}, 39},
		{&meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_TOOL, TokensAfterCancel: 9}, 0},
	} {
		if got := nodes.OrphanTokens(c.n); got != c.want {
			t.Errorf("OrphanTokens(%v) = %d, want %d", c.n, got, c.want)
		}
	}
}
