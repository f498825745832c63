package nodes_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

// A summary (ListNodes with the run's cancel instant) observes each cancelled node's
// propagation once, from the run's cancel instant to the node's cancelled_at, and calls
// Summarized once per ended node; running nodes, notes, nodes stopped before the cancel
// and later summaries add nothing.
func TestSummaryMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := nodes.NewMetrics(reg, meshv1.NodeKind_NODE_KIND_MODEL, meshv1.NodeKind_NODE_KIND_TOOL)
	if n := testutil.CollectAndCount(reg, "curfew_cancel_propagation_seconds"); n != 2 {
		t.Fatalf("%d series before any cancel, want the 2 kinds initialized", n)
	}
	tab := nodes.New(0)
	var summarized []string
	srv := &nodes.Server{Table: tab, Metrics: m, Summarized: func(run string, n *meshv1.Node) { summarized = append(summarized, run+" "+n.GetId()) }}

	cancelAt := time.Now()
	ctx := context.Background()
	begin := func(id string, kind meshv1.NodeKind) context.Context {
		c, _ := tab.Begin(ctx, "r", &meshv1.Node{Id: id, Kind: kind})
		return c
	}
	// Stopped 7 ms after the cancel.
	c1 := begin("root/m0", meshv1.NodeKind_NODE_KIND_MODEL)
	tab.Cancel("r", []string{"root/m0"}, errors.New("operator"))
	tab.Finish(c1, "r", "root/m0", c1.Err(), func(n *meshv1.Node) { n.CancelledAt = timestamppb.New(cancelAt.Add(7 * time.Millisecond)) })
	// Stopped by something else before the cancel.
	c2 := begin("root/s0.t0", meshv1.NodeKind_NODE_KIND_TOOL)
	tab.Cancel("r", []string{"root/s0.t0"}, errors.New("sibling"))
	tab.Finish(c2, "r", "root/s0.t0", c2.Err(), func(n *meshv1.Node) { n.CancelledAt = timestamppb.New(cancelAt.Add(-time.Second)) })
	// Stopped on a cancelled child's error before its own cancel arrived: no
	// cancelled_at, observed at its end (at least 0 s after the cancel, within the test).
	c5 := begin("root/s0.t4", meshv1.NodeKind_NODE_KIND_TOOL)
	tab.Finish(c5, "r", "root/s0.t4", status.Error(codes.Canceled, "child cancelled"), nil)
	// Succeeded.
	c3 := begin("root/s0.t1", meshv1.NodeKind_NODE_KIND_TOOL)
	tab.Finish(c3, "r", "root/s0.t1", nil, nil)
	// Still running, and a note.
	c4 := begin("root/s0.t2", meshv1.NodeKind_NODE_KIND_TOOL)
	tab.Note("r", "root/s0.t3", meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED, cancelAt)

	// Without the cancel instant (a live GetRun): nothing.
	if _, err := srv.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r"}); err != nil {
		t.Fatal(err)
	}
	if len(summarized) != 0 {
		t.Fatalf("a listing without cancel_at summarized %v", summarized)
	}
	req := &meshv1.ListNodesRequest{RunId: "r", CancelAt: timestamppb.New(cancelAt)}
	for range 2 {
		if _, err := srv.ListNodes(ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	if got := len(summarized); got != 4 || summarized[0] != "r root/m0" {
		t.Errorf("summarized %v, want the 4 ended nodes once each", summarized)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]uint64{}
	var sum float64
	for _, mf := range mfs {
		for _, s := range mf.GetMetric() {
			counts[s.GetLabel()[0].GetValue()] = s.GetHistogram().GetSampleCount()
			sum += s.GetHistogram().GetSampleSum()
		}
	}
	if counts["model"] != 1 || counts["tool"] != 1 || sum < 0.0069 || sum > 0.0071+time.Since(cancelAt).Seconds() {
		t.Errorf("propagation observed %v with sum %.4fs, want one model node at 7 ms and one tool node at its end", counts, sum)
	}
	// The running node ends later: the next summary counts it.
	tab.Finish(c4, "r", "root/s0.t2", nil, nil)
	if _, err := srv.ListNodes(ctx, req); err != nil {
		t.Fatal(err)
	}
	if len(summarized) != 5 || summarized[4] != "r root/s0.t2" {
		t.Errorf("summarized %v, want root/s0.t2 added", summarized)
	}
	if nodes.KindName(meshv1.NodeKind_NODE_KIND_SUBAGENT) != "subagent" {
		t.Errorf("KindName = %q", nodes.KindName(meshv1.NodeKind_NODE_KIND_SUBAGENT))
	}
}
