package toolrunner

import (
	"context"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
)

// events sends the node events of one Execute call on its stream while the tool's node
// runs: the tool's own (progress) and those forwarded from beneath it (a subagent's).
// It shares the stream's send lock with the node updates and the result, so that what
// the tool reports leaves in the order it happened. Once the node has ended (end) it
// drops whatever still arrives: a node sends no event after its end.
type events struct {
	mu     *sync.Mutex // the stream's send lock
	stream toolrunnerv1.ToolRunnerService_ExecuteServer
	node   string // the tool's node id
	ended  bool
}

// send sends ev: for the tool's own node when it names none, stamped now when it
// carries no time. Dropped once the node has ended. The tool gives ev away.
func (e *events) send(ev *meshv1.NodeEvent) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ended {
		return
	}
	if ev.GetNodeId() == "" {
		ev.NodeId = e.node
	}
	if ev.GetAt() == nil {
		ev.At = timestamppb.Now()
	}
	// A failed send is the caller gone: the tool's context says so and it stops.
	_ = e.stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_NodeEvent{NodeEvent: ev}})
}

// end stops the events: the tool's node has ended. Every event sent before it has left.
func (e *events) end() {
	e.mu.Lock()
	e.ended = true
	e.mu.Unlock()
}

// progress is a Progress event of the sender's node.
func progress(done, total float64, msg string) *meshv1.NodeEvent {
	return &meshv1.NodeEvent{Kind: &meshv1.NodeEvent_Progress{Progress: &meshv1.Progress{Progress: done, Total: total, Message: msg}}}
}

// sleepReporting waits ms milliseconds or until ctx is done, like sleep, and with every
// > 0 reports every that many milliseconds how many have passed:
// Progress{progress: every, 2·every, …, total: ms}. The reports are strictly before the
// end (the node's end says it is complete) and keep to the start's clock, so a slow
// report does not stretch the wait.
func sleepReporting(ctx context.Context, ms, every int, report func(*meshv1.NodeEvent)) error {
	start := time.Now()
	at := func(ms int) time.Duration { return time.Until(start.Add(time.Duration(ms) * time.Millisecond)) }
	for done := every; every > 0 && done < ms; done += every {
		if err := sleep(ctx, at(done)); err != nil {
			return err
		}
		report(progress(float64(done), float64(ms), ""))
	}
	return sleep(ctx, at(ms))
}
