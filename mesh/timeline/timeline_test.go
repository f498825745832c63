package timeline_test

import (
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/timeline"
)

func at(ms int) *timestamppb.Timestamp {
	return timestamppb.New(time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC).Add(time.Duration(ms) * time.Millisecond))
}

func ExampleNew() {
	tl := timeline.New(&orchestratorv1.Run{RunId: "r1", Status: orchestratorv1.RunStatus_RUN_STATUS_CANCELLED,
		Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR, CreatedAt: at(0), Deadline: at(4000), CancelledAt: at(1000),
		Nodes: []*meshv1.Node{{Id: "root/m0", Kind: meshv1.NodeKind_NODE_KIND_MODEL, StartedAt: at(10), EndedAt: at(1005), Deadline: at(4000),
			Tokens: 41, TokensAfterCancel: 1}}})
	n := tl.Nodes[0]
	fmt.Println(tl.Status, tl.Cause, *tl.CancelMS, n.Kind, *n.EndAfterCancelMS, *n.LeftMS, n.TokensAfterCancel, tl.Span(0))
	// Output: cancelled operator 1000 model 5 2995 1 4000
}

func TestSpanLeavesOutAFarDeadline(t *testing.T) {
	tl := timeline.New(&orchestratorv1.Run{CreatedAt: at(0), Deadline: at(600_000),
		Nodes: []*meshv1.Node{{Id: "root", StartedAt: at(0), EndedAt: at(2000)}}})
	if got := tl.Span(0); got != 2000 {
		t.Errorf("span %v, want 2000 (a 10-minute deadline is left out)", got)
	}
	if got := tl.Span(200_000); got != 600_000 {
		t.Errorf("span at 200 s %v, want the deadline 600000", got)
	}
	if got := timeline.New(&orchestratorv1.Run{CreatedAt: at(0)}).Span(0); got != 1 {
		t.Errorf("empty span %v, want 1", got)
	}
}
