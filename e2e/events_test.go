package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Node events from a tool on toolrunner, directly under the run and inside a subagent,
// reach Run's stream through the agent loops, subagent's Spawn and toolrunner's
// spawn_subagent forwarding: in order, each between its node's start and end.

// progressPlan runs a reporting sleep at the top level (root/s0.t0) and one inside a
// subagent (root/s0.t1/sub/s0.t0).
func progressPlan(ms, every int) string {
	sleep := fmt.Sprintf(`{"name": "sleep", "args": {"ms": %d, "progress_ms": %d}}`, ms, every)
	return `{"tokens_per_second": 1000, "steps": [
	  {"think_tokens": 2, "tools": [` + sleep + `,
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 1000, "steps": [
	      {"think_tokens": 2, "tools": [` + sleep + `]},
	      {"answer_tokens": 2}]}}}]},
	  {"answer_tokens": 2}]}`
}

const (
	topSleep    = "root/s0.t0"
	nestedSleep = "root/s0.t1/sub/s0.t0"
)

// streamed is one message of a run's stream: a node update or a node event.
type streamed struct {
	node *meshv1.Node
	ev   *meshv1.NodeEvent
}

func (s streamed) String() string {
	if s.node != nil {
		return "node " + s.node.GetId() + " " + strings.TrimPrefix(s.node.GetStatus().String(), "NODE_STATUS_")
	}
	if d := s.ev.GetText(); d != nil {
		return fmt.Sprintf("text %s %d %q", s.ev.GetNodeId(), d.GetOffset(), d.GetText())
	}
	return fmt.Sprintf("event %s %g/%g", s.ev.GetNodeId(), s.ev.GetProgress().GetProgress(), s.ev.GetProgress().GetTotal())
}

// tape records a run's stream as it arrives, for a test to read while it goes on.
type tape struct {
	mu       sync.Mutex
	id       string // the run's, once started
	msgs     []streamed
	finished *orchestratorv1.Run
	err      error
	done     chan struct{}
}

// message is what a test reads of a Run or WatchRun message.
type message struct {
	started  *orchestratorv1.RunStarted
	node     *meshv1.Node
	ev       *meshv1.NodeEvent
	finished *orchestratorv1.Run
}

// record reads st until it ends.
func record[T any](st grpc.ServerStreamingClient[T], split func(*T) message) *tape {
	tp := &tape{done: make(chan struct{})}
	go func() {
		defer close(tp.done)
		for {
			m, err := st.Recv()
			tp.mu.Lock()
			if err != nil {
				if !errors.Is(err, io.EOF) {
					tp.err = err
				}
				tp.mu.Unlock()
				return
			}
			switch msg := split(m); {
			case msg.started != nil:
				tp.id = msg.started.GetRunId()
			case msg.node != nil || msg.ev != nil:
				tp.msgs = append(tp.msgs, streamed{node: msg.node, ev: msg.ev})
			case msg.finished != nil:
				tp.finished = msg.finished
			}
			tp.mu.Unlock()
		}
	}()
	return tp
}

func splitRun(m *orchestratorv1.RunResponse) message {
	return message{m.GetStarted(), m.GetNode(), m.GetNodeEvent(), m.GetFinished()}
}

func splitWatch(m *orchestratorv1.WatchRunResponse) message {
	return message{m.GetStarted(), m.GetNode(), m.GetNodeEvent(), m.GetFinished()}
}

// events returns the progress events recorded for node so far.
func (tp *tape) events(node string) []*meshv1.NodeEvent {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	var out []*meshv1.NodeEvent
	for _, m := range tp.msgs {
		if m.ev != nil && m.ev.GetNodeId() == node && m.ev.GetProgress() != nil {
			out = append(out, m.ev)
		}
	}
	return out
}

// waitEvents waits until every node has at least n events on the tape.
func (tp *tape) waitEvents(t *testing.T, n int, nodes ...string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for _, id := range nodes {
		for len(tp.events(id)) < n {
			if time.Now().After(deadline) {
				t.Fatalf("fewer than %d events of %s within 20s:\n%s", n, id, tp.dump())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// waitStarted waits for the run's started event and returns its id.
func (tp *tape) waitStarted(t *testing.T) string {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		tp.mu.Lock()
		id := tp.id
		tp.mu.Unlock()
		if id != "" {
			return id
		}
		if time.Now().After(deadline) {
			t.Fatal("no started event within 20s")
		}
	}
}

func (tp *tape) wait(t *testing.T) {
	t.Helper()
	select {
	case <-tp.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the stream did not end within 30s")
	}
}

func (tp *tape) dump() string {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return tp.dumpLocked()
}

func (tp *tape) dumpLocked() string {
	var b strings.Builder
	for _, m := range tp.msgs {
		b.WriteString(m.String() + "\n")
	}
	return b.String()
}

// checkOrder fails the test unless every event on the tape lies after its node's start
// (unless the stream joined late: a WatchRun may have joined after it) and before its
// node's end, and before the end of every node above it; unless each node's progress
// increases; and unless each node's text deltas follow one another (a late stream's
// first may start anywhere). It returns each node's progress.
func checkOrder(t *testing.T, tp *tape, late bool) map[string][]float64 {
	t.Helper()
	tp.mu.Lock()
	defer tp.mu.Unlock()
	running, ended := map[string]bool{}, map[string]bool{}
	progress := map[string][]float64{}
	textEnd := map[string]int64{} // where each node's next delta follows
	for i, m := range tp.msgs {
		if m.node != nil {
			id := m.node.GetId()
			if m.node.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
				running[id] = true
			} else {
				ended[id] = true
			}
			continue
		}
		id := m.ev.GetNodeId()
		if !running[id] && !late {
			t.Errorf("message %d, %s, before its node started", i, m)
		}
		for a := id; ; a = a[:strings.LastIndexByte(a, '/')] {
			if ended[a] {
				t.Errorf("message %d, %s, after node %s ended", i, m, a)
			}
			if !strings.Contains(a, "/") {
				break
			}
		}
		if d := m.ev.GetText(); d != nil {
			if end, seen := textEnd[id]; (seen || !late) && d.GetOffset() != end {
				t.Errorf("message %d, %s, does not follow the %d bytes before it", i, m, end)
			}
			textEnd[id] = d.GetOffset() + int64(len(d.GetText()))
			continue
		}
		p := progress[id]
		if len(p) > 0 && m.ev.GetProgress().GetProgress() <= p[len(p)-1] {
			t.Errorf("message %d, %s, does not increase on %v", i, m, p[len(p)-1])
		}
		progress[id] = append(p, m.ev.GetProgress().GetProgress())
	}
	if t.Failed() {
		t.Logf("stream:\n%s", tp.dumpLocked())
	}
	return progress
}

func TestNodeEventsReachRun(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := client(t)
	st, err := c.Run(ctx, &orchestratorv1.RunRequest{Task: progressPlan(600, 100)})
	if err != nil {
		t.Fatal(err)
	}
	tp := record(st, splitRun)
	tp.wait(t)
	if tp.err != nil || tp.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run: %v, %v", tp.err, tp.finished)
	}
	progress := checkOrder(t, tp, false)
	for _, id := range []string{topSleep, nestedSleep} {
		// Every 100 ms of 600, strictly before the end, none lost on an attentive stream.
		if got := fmt.Sprint(progress[id]); got != "[100 200 300 400 500]" {
			t.Errorf("%s reported %s, want [100 200 300 400 500]", id, got)
		}
		// Each event stamped by toolrunner while the node ran, by its own record.
		n := nodeMap(tp.finished)[id]
		for _, ev := range tp.events(id) {
			if at := ev.GetAt().AsTime(); at.Before(n.GetStartedAt().AsTime()) || at.After(n.GetEndedAt().AsTime()) {
				t.Errorf("%s: event at %s outside its node's run %s..%s", id, fmtTime(at), fmtTime(n.GetStartedAt().AsTime()), fmtTime(n.GetEndedAt().AsTime()))
			}
			if ev.GetProgress().GetTotal() != 600 {
				t.Errorf("%s: event %v, want total 600", id, ev)
			}
		}
	}
	if t.Failed() {
		t.Logf("%s", dump(tp.finished))
	}
}

// A run cancelled while its tools report: the progress stops at each node's cancelled
// end, on Run's stream and on a WatchRun that joined late; that watcher first got the
// latest progress of each running tool.
func TestNodeEventsStopAtCancel(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := client(t)
	st, err := c.Run(ctx, &orchestratorv1.RunRequest{Task: progressPlan(60000, 50)})
	if err != nil {
		t.Fatal(err)
	}
	run := record(st, splitRun)
	run.waitEvents(t, 3, topSleep, nestedSleep)
	run.mu.Lock()
	id := run.id
	run.mu.Unlock()
	ws, err := c.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	watch := record(ws, splitWatch)
	watch.waitEvents(t, 2, topSleep, nestedSleep)

	if _, err := c.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "e2e: node events stop"}); err != nil {
		t.Fatal(err)
	}
	run.wait(t)
	watch.wait(t)
	if run.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || watch.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
		t.Fatalf("run ended %v / watched %v, want CANCELLED", run.finished.GetStatus(), watch.finished.GetStatus())
	}
	t.Run("Run", func(t *testing.T) { checkOrder(t, run, false) })
	t.Run("WatchRun", func(t *testing.T) { checkOrder(t, watch, true) })

	// The watcher joined while both tools ran, after at least 3 reports of each: its
	// first messages are their latest progress, not the history before it joined.
	watch.mu.Lock()
	first := watch.msgs[:2]
	watch.mu.Unlock()
	for _, m := range first {
		if m.ev == nil || (m.ev.GetNodeId() != topSleep && m.ev.GetNodeId() != nestedSleep) || m.ev.GetProgress().GetProgress() < 150 {
			t.Errorf("WatchRun began with %s, want the latest progress of both running tools", m)
		}
	}
	for _, id := range []string{topSleep, nestedSleep} {
		if w, r := len(watch.events(id)), len(run.events(id)); w > r-2 {
			t.Errorf("WatchRun got %d events of %s, Run %d: want the replay of the latest only", w, id, r)
		}
	}
	// The tools' ends are on Run's stream, cancelled (checkOrder saw nothing after them).
	run.mu.Lock()
	defer run.mu.Unlock()
	for _, id := range []string{topSleep, "root/s0.t1"} {
		found := false
		for _, m := range run.msgs {
			found = found || (m.node != nil && m.node.GetId() == id && m.node.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED)
		}
		if !found {
			t.Errorf("no cancelled end of %s on Run's stream:\n%s", id, run.dumpLocked())
		}
	}
}

// A client chooses what its stream carries (RunRequest.events, WatchRunRequest.events):
// the summary alone, or node updates without node events; the summary holds every node
// either way.
func TestRunStreamsTheEventsAskedFor(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := client(t)
	st, err := c.Run(ctx, &orchestratorv1.RunRequest{Task: progressPlan(600, 100), Events: orchestratorv1.RunEvents_RUN_EVENTS_NODES})
	if err != nil {
		t.Fatal(err)
	}
	nodes := record(st, splitRun)
	// A watcher of the summary alone, and one of node updates, joining while it runs.
	id := nodes.waitStarted(t)
	ws, err := c.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id, Events: orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY})
	if err != nil {
		t.Fatal(err)
	}
	watchSummary := record(ws, splitWatch)
	wn, err := c.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id, Events: orchestratorv1.RunEvents_RUN_EVENTS_NODES})
	if err != nil {
		t.Fatal(err)
	}
	watchNodes := record(wn, splitWatch)
	ss, err := c.Run(ctx, &orchestratorv1.RunRequest{Task: progressPlan(300, 100), Events: orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY})
	if err != nil {
		t.Fatal(err)
	}
	summary := record(ss, splitRun)
	for name, tp := range map[string]*tape{"Run, nodes": nodes, "Run, summary": summary, "WatchRun, summary": watchSummary, "WatchRun, nodes": watchNodes} {
		tp.wait(t)
		if tp.err != nil || tp.id == "" || tp.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("%s: started %q, %v, %v", name, tp.id, tp.err, tp.finished)
		}
		// The run; its 2 model steps and 2 tools (a sleep, spawn_subagent); the subagent,
		// its 2 model steps and its sleep.
		if n := len(tp.finished.GetNodes()); n != 9 {
			t.Errorf("%s: summary has %d nodes, want every node:\n%s", name, n, dump(tp.finished))
		}
		var gotNodes, gotEvents int
		for _, m := range tp.msgs {
			if m.ev != nil {
				gotEvents++
			} else {
				gotNodes++
			}
		}
		wantNodes := strings.HasSuffix(name, "nodes")
		if gotEvents != 0 || wantNodes != (gotNodes > 0) {
			t.Errorf("%s: %d node updates and %d node events streamed, want %s:\n%s", name, gotNodes, gotEvents,
				map[bool]string{true: "node updates and no events", false: "neither"}[wantNodes], tp.dump())
		}
	}
	bad, err := c.Run(ctx, &orchestratorv1.RunRequest{Task: progressPlan(300, 100), Events: 7})
	if err == nil {
		_, err = bad.Recv()
	}
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("Run with events 7: %v, want INVALID_ARGUMENT", err)
	}
}
