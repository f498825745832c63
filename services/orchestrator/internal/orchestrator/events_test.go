package orchestrator

import (
	"fmt"
	"strings"
	"testing"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

func testNode(id string, st meshv1.NodeStatus) *meshv1.Node { return &meshv1.Node{Id: id, Status: st} }

func runningNode(id string) *meshv1.Node { return testNode(id, meshv1.NodeStatus_NODE_STATUS_RUNNING) }

func endedNode(id string) *meshv1.Node { return testNode(id, meshv1.NodeStatus_NODE_STATUS_SUCCEEDED) }

func prog(id string, p float64) *meshv1.NodeEvent {
	return &meshv1.NodeEvent{NodeId: id, Kind: &meshv1.NodeEvent_Progress{Progress: &meshv1.Progress{Progress: p, Total: 100}}}
}

// received is what a subscriber has been sent so far: "node ID STATUS" or "event ID P".
func received(c chan *orchestratorv1.RunResponse) []string {
	var out []string
	for {
		select {
		case ev := <-c:
			switch e := ev.GetEvent().(type) {
			case *orchestratorv1.RunResponse_Node:
				out = append(out, "node "+e.Node.GetId()+" "+strings.TrimPrefix(e.Node.GetStatus().String(), "NODE_STATUS_"))
			case *orchestratorv1.RunResponse_NodeEvent:
				out = append(out, fmt.Sprintf("event %s %g", e.NodeEvent.GetNodeId(), e.NodeEvent.GetProgress().GetProgress()))
			}
		default:
			return out
		}
	}
}

func wantReceived(t *testing.T, c chan *orchestratorv1.RunResponse, want ...string) {
	t.Helper()
	if got := received(c); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("received:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// A node event goes out between its node's start and end, in order with the nodes; one
// before the start or after the end (of the node, or of a node above it) is dropped.
func TestNodeEventsOnlyWhileTheNodeRuns(t *testing.T) {
	rn := &run{}
	sub := rn.subscribe()
	rn.publishEvent(prog("root/s0.t0", 1)) // before its start
	rn.publishNode(runningNode("root/s0.t0"))
	rn.publishEvent(prog("root/s0.t0", 2))
	rn.publishNode(runningNode("root/s0.t0/sub"))
	rn.publishNode(runningNode("root/s0.t0/sub/s0.t0"))
	rn.publishEvent(prog("root/s0.t0/sub/s0.t0", 3))
	rn.publishNode(endedNode("root/s0.t0")) // the nested nodes' own ends were lost with its stream
	rn.publishEvent(prog("root/s0.t0", 4))
	rn.publishEvent(prog("root/s0.t0/sub/s0.t0", 5))
	wantReceived(t, sub,
		"node root/s0.t0 RUNNING",
		"event root/s0.t0 2",
		"node root/s0.t0/sub RUNNING",
		"node root/s0.t0/sub/s0.t0 RUNNING",
		"event root/s0.t0/sub/s0.t0 3",
		"node root/s0.t0 SUCCEEDED",
	)
	if rn.running != nil {
		t.Fatalf("running = %v after every node ended, want nothing kept", rn.running)
	}
	// A node started again (a run resumed from its journal) sends events again.
	rn.publishNode(runningNode("root/s0.t0"))
	rn.publishEvent(prog("root/s0.t0", 6))
	wantReceived(t, sub, "node root/s0.t0 RUNNING", "event root/s0.t0 6")
}

// A subscriber that arrives late is sent the latest progress of each node running then,
// first; nothing of the nodes that ended, nor earlier progress.
func TestLateSubscriberGetsLatestProgressOfRunningNodes(t *testing.T) {
	rn := &run{}
	for _, id := range []string{"root/s0.t1", "root/s0.t0", "root/s0.t2"} {
		rn.publishNode(runningNode(id))
	}
	rn.publishNode(runningNode("root/m1")) // running, no progress
	for p := 1.0; p <= 3; p++ {
		rn.publishEvent(prog("root/s0.t0", p))
		rn.publishEvent(prog("root/s0.t1", 10*p))
		rn.publishEvent(prog("root/s0.t2", 100*p))
	}
	rn.publishNode(endedNode("root/s0.t2"))
	late := rn.subscribe()
	rn.publishEvent(prog("root/s0.t0", 4))
	wantReceived(t, late,
		"event root/s0.t0 3",
		"event root/s0.t1 30",
		"event root/s0.t0 4",
	)
	if n := len(rn.running["root/s0.t0"]); n != 1 {
		t.Fatalf("node keeps %d events, want the latest progress only", n)
	}
}

// The nodes a run tracks are bounded; a node beyond the bound sends no events, and the
// replay a late subscriber gets leaves room in its buffer.
func TestRunningNodesBounded(t *testing.T) {
	rn := &run{}
	for i := range maxRunningNodes + 10 {
		id := fmt.Sprintf("root/s0.t%d", i)
		rn.publishNode(runningNode(id))
		rn.publishEvent(prog(id, 1))
	}
	if len(rn.running) != maxRunningNodes {
		t.Fatalf("tracking %d running nodes, want at most %d", len(rn.running), maxRunningNodes)
	}
	late := rn.subscribe()
	if n := len(late); n == 0 || n > eventBuffer/2 {
		t.Fatalf("replayed %d events, want some and at most half the buffer (%d)", n, eventBuffer/2)
	}
	rn.publishNode(endedNode("root"))
	if rn.running != nil {
		t.Fatalf("running = %d nodes after the root ended, want none", len(rn.running))
	}
}
