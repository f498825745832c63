package orchestrator

import (
	"fmt"
	"strings"
	"testing"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

func testNode(id string, st meshv1.NodeStatus) *meshv1.Node { return &meshv1.Node{Id: id, Status: st} }

func runningNode(id string) *meshv1.Node { return testNode(id, meshv1.NodeStatus_NODE_STATUS_RUNNING) }

func endedNode(id string) *meshv1.Node { return testNode(id, meshv1.NodeStatus_NODE_STATUS_SUCCEEDED) }

func prog(id string, p float64) *meshv1.NodeEvent {
	return &meshv1.NodeEvent{NodeId: id, Kind: &meshv1.NodeEvent_Progress{Progress: &meshv1.Progress{Progress: p, Total: 100}}}
}

// received is what a subscriber has been sent so far: "node ID STATUS", "event ID P" or
// "text ID OFFSET TEXT".
func received(c chan *orchestratorv1.RunResponse) []string {
	var out []string
	for {
		select {
		case ev := <-c:
			switch e := ev.GetEvent().(type) {
			case *orchestratorv1.RunResponse_Node:
				out = append(out, "node "+e.Node.GetId()+" "+strings.TrimPrefix(e.Node.GetStatus().String(), "NODE_STATUS_"))
			case *orchestratorv1.RunResponse_NodeEvent:
				if d := e.NodeEvent.GetText(); d != nil {
					out = append(out, fmt.Sprintf("text %s %d %s", e.NodeEvent.GetNodeId(), d.GetOffset(), d.GetText()))
					continue
				}
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
	sub := rn.subscribe(detailAll)
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
	late := rn.subscribe(detailAll)
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
	late := rn.subscribe(detailAll)
	if n := len(late); n == 0 || n > eventBuffer/2 {
		t.Fatalf("replayed %d events, want some and at most half the buffer (%d)", n, eventBuffer/2)
	}
	rn.publishNode(endedNode("root"))
	if rn.running != nil {
		t.Fatalf("running = %d nodes after the root ended, want none", len(rn.running))
	}
}

func textEv(id string, offset int, text string) *meshv1.NodeEvent {
	return &meshv1.NodeEvent{NodeId: id, Kind: &meshv1.NodeEvent_Text{Text: &meshv1.TextDelta{Text: text, Offset: int64(offset)}}}
}

// A model node's text deltas go out in order with its node, never after its end (nor
// the end of a node above it); what was kept of its text goes with the end.
func TestTextDeltasOnlyWhileTheNodeRuns(t *testing.T) {
	rn := &run{}
	sub := rn.subscribe(detailAll)
	rn.publishNode(runningNode("root/m0"))
	rn.publishEvent(textEv("root/m0", 0, "hello"))
	rn.publishEvent(textEv("root/m0", 5, " world"))
	rn.publishNode(runningNode("root/s0.t0"))
	rn.publishNode(runningNode("root/s0.t0/sub/m0"))
	rn.publishEvent(textEv("root/s0.t0/sub/m0", 0, "nested"))
	rn.publishNode(endedNode("root/m0"))
	rn.publishEvent(textEv("root/m0", 11, " late"))
	rn.publishNode(endedNode("root/s0.t0")) // the subagent's model node ends with it
	rn.publishEvent(textEv("root/s0.t0/sub/m0", 6, " late"))
	wantReceived(t, sub,
		"node root/m0 RUNNING",
		"text root/m0 0 hello",
		"text root/m0 5  world",
		"node root/s0.t0 RUNNING",
		"node root/s0.t0/sub/m0 RUNNING",
		"text root/s0.t0/sub/m0 0 nested",
		"node root/m0 SUCCEEDED",
		"node root/s0.t0 SUCCEEDED",
	)
	if rn.text != nil || rn.textBytes != 0 {
		t.Fatalf("text kept after every node ended: %v (%d bytes)", rn.text, rn.textBytes)
	}
}

// A subscriber that arrives late is sent the text so far of each running model node as
// one delta at offset 0, then the deltas that follow; nothing of an ended node's text.
func TestLateSubscriberGetsTextSoFar(t *testing.T) {
	rn := &run{}
	rn.publishNode(runningNode("root/m0"))
	rn.publishEvent(textEv("root/m0", 0, "think"))
	rn.publishNode(endedNode("root/m0"))
	rn.publishNode(runningNode("root/m1"))
	rn.publishEvent(textEv("root/m1", 0, "the"))
	rn.publishEvent(textEv("root/m1", 3, " answer"))
	rn.publishNode(runningNode("root/s1.t0"))
	rn.publishEvent(prog("root/s1.t0", 7))
	sub := rn.subscribe(detailAll)
	rn.publishEvent(textEv("root/m1", 10, " is"))
	wantReceived(t, sub,
		"text root/m1 0 the answer",
		"event root/s1.t0 7",
		"text root/m1 10  is",
	)
}

// The text kept for late subscribers is bounded: the latest maxNodeText bytes of a node,
// cut at a character's start, at the offset where they begin; maxRunText in all, beyond
// which a node is replayed without text until its next delta fits.
func TestKeptTextIsBounded(t *testing.T) {
	rn := &run{}
	rn.publishNode(runningNode("root/m0"))
	chunk := strings.Repeat("é", 1000) // 2 bytes a character
	off := 0
	for range 20 {
		rn.publishEvent(textEv("root/m0", off, chunk))
		off += len(chunk)
	}
	kt := rn.text["root/m0"]
	if len(kt.text) > maxNodeText || len(kt.text) < maxNodeText-1 || !utf8.ValidString(kt.text) {
		t.Fatalf("kept %d bytes (valid UTF-8: %v), want the last %d, whole characters", len(kt.text), utf8.ValidString(kt.text), maxNodeText)
	}
	if kt.offset+int64(len(kt.text)) != int64(off) {
		t.Fatalf("kept text at offset %d, %d bytes: does not end at %d", kt.offset, len(kt.text), off)
	}
	sub := rn.subscribe(detailAll)
	if got := received(sub); len(got) != 1 || !strings.HasPrefix(got[0], fmt.Sprintf("text root/m0 %d é", kt.offset)) {
		t.Fatalf("late subscriber got %.60q, want one delta at offset %d", got, kt.offset)
	}
	rn.unsubscribe(sub)

	// Many nodes: no more than maxRunText in all.
	big := strings.Repeat("x", maxNodeText)
	for i := range 2 * maxRunText / maxNodeText {
		id := fmt.Sprintf("root/s0.t%d/sub/m0", i)
		rn.publishNode(runningNode(id))
		rn.publishEvent(textEv(id, 0, big))
	}
	total := 0
	for _, kt := range rn.text {
		total += len(kt.text)
	}
	if total > maxRunText || total != rn.textBytes {
		t.Fatalf("kept %d bytes (counted %d), want at most %d", total, rn.textBytes, maxRunText)
	}
	// A node ending frees room for the next delta of another.
	rn.publishNode(endedNode("root/m0"))
	last := fmt.Sprintf("root/s0.t%d/sub/m0", 2*maxRunText/maxNodeText-1)
	rn.publishEvent(textEv(last, maxNodeText, "y"))
	if kt := rn.text[last]; kt == nil || kt.text != "y" || kt.offset != maxNodeText {
		t.Fatalf("kept %+v for %s after room was freed, want its latest delta", kt, last)
	}
}

// A subscriber that does not keep up loses node events first: once its buffer is half
// full, only node updates, from which its tree is drawn, still go in.
func TestSlowSubscriberKeepsNodeUpdates(t *testing.T) {
	rn := &run{}
	rn.publishNode(runningNode("root/s0.m0"))
	sub := rn.subscribe(detailAll)
	for i := range eventBuffer {
		rn.publishEvent(textEv("root/s0.m0", i, "x"))
	}
	if n := len(sub); n != eventBuffer/2 {
		t.Fatalf("%d events buffered, want text to stop at half the buffer (%d)", n, eventBuffer/2)
	}
	rn.publishNode(endedNode("root/s0.m0"))
	var last *orchestratorv1.RunResponse
	for len(sub) > 0 {
		last = <-sub
	}
	if last.GetNode().GetId() != "root/s0.m0" || last.GetNode().GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
		t.Fatalf("last event %v, want the node's end", last)
	}
}

// A model node's tokens count every attempt: a stream restarted under the same node goes
// on counting, a step redone after a failure starts a node of the same id from 0, and an
// end published twice counts once.
func TestStreamedTokensCountEveryAttempt(t *testing.T) {
	rn := &run{}
	model := func(status meshv1.NodeStatus, tokens int64) *meshv1.Node {
		return &meshv1.Node{Id: "root/m0", Kind: meshv1.NodeKind_NODE_KIND_MODEL, Status: status, Tokens: tokens}
	}
	const running, failed, ok = meshv1.NodeStatus_NODE_STATUS_RUNNING, meshv1.NodeStatus_NODE_STATUS_FAILED, meshv1.NodeStatus_NODE_STATUS_SUCCEEDED
	for _, n := range []*meshv1.Node{
		model(running, 0), model(running, 20), model(running, 45), // restarted at 30: counting on
		model(failed, 60), model(failed, 60), // cut: the step failed (its end published twice)
		model(running, 0), model(running, 70), model(ok, 120), // redone from 0
	} {
		rn.publishNode(n)
	}
	if got := rn.streamed["root/m0"]; got.total() != 180 || !got.retried {
		t.Fatalf("streamed %d tokens (retried %v), want 60 + 120 over two attempts", got.total(), got.retried)
	}

	// One attempt: the summary keeps its executor's figure. A stream restarted under the
	// same node says so by its Attempt.
	one := &run{}
	one.publishNode(model(running, 10))
	one.publishNode(model(ok, 50))
	if got := one.streamed["root/m0"]; got.total() != 50 || got.retried {
		t.Fatalf("one attempt: %d tokens, retried %v; want 50, false", got.total(), got.retried)
	}
	again := &run{}
	again.publishNode(model(running, 10))
	restarted := model(running, 30)
	restarted.Attempt = 2
	again.publishNode(restarted)
	if !again.streamed["root/m0"].retried {
		t.Fatal("a node on its second attempt is not marked retried")
	}
}

// Each subscriber is sent what it asked for (RunRequest.events): node updates without
// node events for RUN_EVENTS_NODES, and no subscription at all for RUN_EVENTS_SUMMARY;
// a late subscriber of node updates is replayed no events.
func TestSubscribersGetTheDetailTheyAskedFor(t *testing.T) {
	rn := &run{}
	all, nodes, none := rn.subscribe(detailAll), rn.subscribe(detailNodes), rn.subscribe(detailNone)
	if none != nil {
		t.Fatal("a summary-only subscriber got a channel; want none, so that nothing is sent to it")
	}
	rn.publishNode(runningNode("root/m0"))
	rn.publishEvent(textEv("root/m0", 0, "tok "))
	rn.publishEvent(prog("root/m0", 1))
	lateNodes := rn.subscribe(detailNodes)
	rn.publishNode(endedNode("root/m0"))
	wantReceived(t, all, "node root/m0 RUNNING", "text root/m0 0 tok ", "event root/m0 1", "node root/m0 SUCCEEDED")
	wantReceived(t, nodes, "node root/m0 RUNNING", "node root/m0 SUCCEEDED")
	wantReceived(t, lateNodes, "node root/m0 SUCCEEDED")
	rn.unsubscribe(none) // a nil subscription is a no-op
	if len(rn.subs) != 3 {
		t.Fatalf("%d subscribers, want 3", len(rn.subs))
	}
}

// events names every detail, and detailOf reads it back; a value RunEvents does not
// define is INVALID_ARGUMENT.
func TestDetailOfEvents(t *testing.T) {
	for _, d := range []detail{detailNone, detailNodes, detailAll} {
		if got, err := detailOf(d.events()); err != nil || got != d {
			t.Errorf("detailOf(%v) = %v, %v; want %v", d.events(), got, err, d)
		}
	}
	if d, err := detailOf(orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED); err != nil || d != detailAll {
		t.Errorf("unset events = %v, %v; want every event", d, err)
	}
	if _, err := detailOf(orchestratorv1.RunEvents(9)); status.Code(err) != codes.InvalidArgument {
		t.Errorf("events 9: %v, want INVALID_ARGUMENT", err)
	}
}
