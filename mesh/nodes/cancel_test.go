package nodes_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

func TestBeginAndCancel(t *testing.T) {
	tb := nodes.New(0)
	parent := context.WithValue(context.Background(), key{}, "v")
	c1, n1 := tb.Begin(parent, "r", &meshv1.Node{Id: "root/s0.t1", Kind: tool})
	c10, _ := tb.Begin(parent, "r", &meshv1.Node{Id: "root/s0.t10", Kind: tool})
	if n1.Status != running || c1.Value(key{}) != "v" {
		t.Fatalf("Begin = %v; want a running node and a ctx derived from the parent", n1)
	}

	if n := tb.Cancel("r", []string{"root/s0.t1"}, cancel.ErrSiblingFailed); n != 1 {
		t.Fatalf("Cancel(root/s0.t1) cancelled %d nodes, want 1 (not root/s0.t10)", n)
	}
	if !errors.Is(context.Cause(c1), cancel.ErrSiblingFailed) {
		t.Errorf("cancelled node's ctx cause = %v", context.Cause(c1))
	}
	if c10.Err() != nil {
		t.Error("an unselected node was cancelled")
	}
	// The cancelled node ends; End releases it, so a second Cancel finds only t10.
	tb.Finish(c1, "r", "root/s0.t1", c1.Err(), nil)
	if n := tb.Cancel("r", nil, cancel.ErrOperator); n != 1 {
		t.Fatalf("Cancel(all) after t1 ended cancelled %d, want 1", n)
	}
	tb.Finish(c10, "r", "root/s0.t10", nil, nil)
	ns, settled := tb.List(context.Background(), "r", nil, 0)
	if !settled || ns[0].Cause != sibling || ns[1].Cause != operator {
		t.Errorf("nodes = %v; want both ended with the causes they were cancelled with", ns)
	}
	if n := tb.Cancel("r", nil, cancel.ErrOperator); n != 0 {
		t.Errorf("Cancel after every node ended cancelled %d", n)
	}
	if n := tb.Cancel("unknown", nil, cancel.ErrOperator); n != 0 {
		t.Errorf("Cancel(unknown run) = %d", n)
	}
}

type key struct{}

func TestServerCancelNodes(t *testing.T) {
	tb := nodes.New(0)
	c := serveTable(t, &nodes.Server{Table: tb})
	work, _ := tb.Begin(context.Background(), "r", &meshv1.Node{Id: "root/s0.t0", Kind: tool})
	ctx, stop := context.WithTimeout(context.Background(), 3*time.Second)
	defer stop()

	for _, req := range []*meshv1.CancelNodesRequest{
		{Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR},
		{RunId: "r"},
	} {
		if _, err := c.CancelNodes(ctx, req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("CancelNodes(%v) = %v, want INVALID_ARGUMENT", req, err)
		}
	}
	if work.Err() != nil {
		t.Fatal("an invalid request cancelled work")
	}
	resp, err := c.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: "r", Cause: meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT})
	if err != nil || resp.GetCancelled() != 1 {
		t.Fatalf("CancelNodes = %v, %v; want 1 cancelled", resp, err)
	}
	if !errors.Is(context.Cause(work), cancel.ErrClientDisconnect) {
		t.Errorf("work's cause = %v, want client disconnect", context.Cause(work))
	}
	tb.Finish(work, "r", "root/s0.t0", work.Err(), nil)
}

// With a settle_timeout CancelNodes answers once the nodes it cancelled have ended, and
// says whether they all had; a node that outlasts the timeout does not hold it longer.
func TestServerCancelNodesSettles(t *testing.T) {
	tb := nodes.New(0)
	c := serveTable(t, &nodes.Server{Table: tb})
	ctx, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	if _, err := c.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: "r", Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR,
		SettleTimeout: durationpb.New(-time.Second)}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("negative settle_timeout: %v, want INVALID_ARGUMENT", err)
	}

	// Two nodes that take 100 ms to stop once cancelled.
	const teardown = 100 * time.Millisecond
	ended := make(chan time.Time, 2)
	for _, id := range []string{"root/m0", "root/s0/m0"} {
		work, _ := tb.Begin(context.Background(), "r", &meshv1.Node{Id: id, Kind: meshv1.NodeKind_NODE_KIND_MODEL})
		go func() {
			<-work.Done()
			time.Sleep(teardown)
			tb.Finish(work, "r", id, work.Err(), nil)
			ended <- time.Now()
		}()
	}
	resp, err := c.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: "r", Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR,
		SettleTimeout: durationpb.New(5 * time.Second)})
	answered := time.Now()
	if err != nil || resp.GetCancelled() != 2 || !resp.GetSettled() {
		t.Fatalf("CancelNodes with a settle timeout = %v, %v; want 2 cancelled, settled", resp, err)
	}
	for range 2 {
		if e := <-ended; e.After(answered) {
			t.Fatalf("CancelNodes answered %v before a node ended", e.Sub(answered))
		}
	}

	// A node that takes 2 s: a 50 ms settle answers unsettled, long before it ends.
	work, _ := tb.Begin(context.Background(), "r", &meshv1.Node{Id: "root/m1", Kind: meshv1.NodeKind_NODE_KIND_MODEL})
	go func() {
		<-work.Done()
		time.Sleep(2 * time.Second)
		tb.Finish(work, "r", "root/m1", work.Err(), nil)
		ended <- time.Now()
	}()
	resp, err = c.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: "r", Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR,
		SettleTimeout: durationpb.New(50 * time.Millisecond)})
	answered = time.Now()
	if err != nil || resp.GetCancelled() != 1 || resp.GetSettled() {
		t.Fatalf("CancelNodes = %v, %v; want 1 cancelled, not settled", resp, err)
	}
	if e := <-ended; e.Sub(answered) < time.Second {
		t.Fatalf("the node ended %v after the answer; want the answer not to wait for it", e.Sub(answered))
	}

	// Nothing left to cancel: settled at once; without a settle_timeout, never "settled".
	if resp, err := c.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: "r", Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR,
		SettleTimeout: durationpb.New(time.Second)}); err != nil || resp.GetCancelled() != 0 || !resp.GetSettled() {
		t.Fatalf("CancelNodes with nothing running = %v, %v; want 0 cancelled, settled", resp, err)
	}
	if resp, err := c.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: "r", Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR}); err != nil || resp.GetSettled() {
		t.Fatalf("CancelNodes without a settle timeout = %v, %v; want settled false", resp, err)
	}
}

// A run's cancel (CancelNodes) is remembered: a node it selects that arrives after it is
// refused by BeginLive with the cancel's cause and never recorded; one outside its
// prefixes, or of another run, begins; Begin itself is not refused.
func TestBeginLiveAfterCancelRun(t *testing.T) {
	tab := nodes.New(0)
	ctx := context.Background()
	if _, _, err := tab.BeginLive(ctx, "r1", &meshv1.Node{Id: "root/s0", Kind: meshv1.NodeKind_NODE_KIND_MODEL}); err != nil {
		t.Fatal(err)
	}
	srv := &nodes.Server{Table: tab}
	resp, err := srv.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: "r1", NodePrefixes: []string{"root"}, Cause: meshv1.CancelCause_CANCEL_CAUSE_BUDGET})
	if err != nil || resp.GetCancelled() != 1 {
		t.Fatalf("CancelNodes = %v, %v; want the running node cancelled", resp, err)
	}
	_, n, err := tab.BeginLive(ctx, "r1", &meshv1.Node{Id: "root/s1", Kind: meshv1.NodeKind_NODE_KIND_MODEL})
	if !errors.Is(err, cancel.ErrBudget) || n != nil {
		t.Fatalf("BeginLive after the run's cancel = %v, %v; want cause budget", n, err)
	}
	ns, _ := tab.List(ctx, "r1", nil, 0)
	for _, n := range ns {
		if n.GetId() == "root/s1" {
			t.Errorf("the refused node was recorded: %v", n)
		}
	}
	for _, c := range []struct{ run, id string }{{"r1", "other/s0"}, {"r2", "root/s1"}} {
		cctx, _, err := tab.BeginLive(ctx, c.run, &meshv1.Node{Id: c.id, Kind: meshv1.NodeKind_NODE_KIND_MODEL})
		if err != nil || cctx.Err() != nil {
			t.Errorf("BeginLive(%s, %s) = %v: not selected by the cancel", c.run, c.id, err)
		}
	}
	if cctx, _ := tab.Begin(ctx, "r1", &meshv1.Node{Id: "root/s2"}); cctx.Err() != nil {
		t.Error("Begin was refused")
	}
}
