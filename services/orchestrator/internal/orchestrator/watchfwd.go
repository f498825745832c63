package orchestrator

import (
	"context"
	"reflect"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// A WatchRun of a run that another orchestrator owns is relayed from the owner: the
// replica the client reached opens WatchRun on the owner (the address its lease names, as
// for CancelRun forwarding, cancelfwd.go) and passes its events on, so that the run is
// followed live whichever replica serves the watch. The forwarded call carries the
// caller's API key (or, between mesh peers, the tenant authenticated here), so the owner
// applies the same tenant isolation; and the run was first read from the store under the
// caller's tenant, so another tenant's run is NOT_FOUND before anything is forwarded.
//
// The forwarded call is marked (md.CancelForwarded) and never forwarded again: an
// orchestrator that receives one for a run it does not hold (it moved, or was never
// there) answers UNAVAILABLE at once instead of polling the store, and the relaying
// replica looks the run up again. When the owner's stream ends without the summary (the
// owner died, drained, or lost the run), the relaying replica reads the run again: a new
// owner is relayed from in turn, a run this replica took over is followed here, and an
// ended run gets its summary. An owner that cannot be reached is tried again at most
// every watchForwardRetry; meanwhile the run is polled in the store as before (its
// summary at its end, no events), so the watch never fails for that.
//
// Across a switch from one source to the next the client gets one started event and one
// summary; what the new source replays of the nodes running then (see run.subscribe) is
// deduplicated (watcher): a progress event equal to the last one sent for its node is
// dropped, and text the client already holds (by offset) is cut off. A client may still
// see node updates again (a node the new owner resumes or repeats), and it may miss the
// node updates and events of the moments between two sources: the summary has every
// node.

// Bounds of a relayed WatchRun.
const (
	// watchForwardOpen bounds the wait for the owner's first event (its started event,
	// which it sends at once): an owner that does not answer by then (an address that
	// drops packets) is left, and the run is polled in the store.
	watchForwardOpen = 2 * time.Second
	// watchForwardRetry is the least time between two relays from the same owner: an
	// owner that is unreachable, or whose stream ended without the summary while the
	// store still names it, is tried again after it, not at every poll.
	watchForwardRetry = time.Second
)

// watcher is one WatchRun stream to its client, across the sources it follows in turn:
// this process's run, an owner's relayed stream, the store. It sends one started event
// and drops what a new source replays that the client already has.
type watcher struct {
	stream  orchestratorv1.OrchestratorService_WatchRunServer
	events  detail // what the client asked for: what is not is dropped
	started bool
	// last holds, per running node, the latest event of each replayed kind sent
	// (replayed, keepLatest); textEnd the offset at which the text sent of a model node
	// ends. Both forget a node at its end, and hold at most maxRunningNodes nodes (beyond
	// that, events pass as they come).
	last    map[string][]*meshv1.NodeEvent
	textEnd map[string]int64
}

func newWatcher(stream orchestratorv1.OrchestratorService_WatchRunServer, events detail) *watcher {
	return &watcher{stream: stream, events: events, last: map[string][]*meshv1.NodeEvent{}, textEnd: map[string]int64{}}
}

// sendStarted sends the run's started event, once per watch.
func (w *watcher) sendStarted(r *orchestratorv1.Run) error {
	return w.sendStartedEvent(&orchestratorv1.RunStarted{RunId: r.GetRunId(), Deadline: r.GetDeadline()})
}

func (w *watcher) sendStartedEvent(st *orchestratorv1.RunStarted) error {
	if w.started {
		return nil
	}
	w.started = true
	return w.stream.Send(&orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_Started{Started: st}})
}

// finish sends the summary (after the started event, if it was not sent yet).
func (w *watcher) finish(r *orchestratorv1.Run) error {
	if err := w.sendStarted(r); err != nil {
		return err
	}
	return w.stream.Send(&orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_Finished{Finished: r}})
}

// sendNode sends a node update; a node's end forgets what was sent of it and of the
// nodes beneath it.
func (w *watcher) sendNode(n *meshv1.Node) error {
	if w.events < detailNodes {
		return nil
	}
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING {
		id := n.GetId()
		for k := range w.last {
			if k == id || strings.HasPrefix(k, id+"/") {
				delete(w.last, k)
			}
		}
		for k := range w.textEnd {
			if k == id || strings.HasPrefix(k, id+"/") {
				delete(w.textEnd, k)
			}
		}
	}
	return w.stream.Send(&orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_Node{Node: n}})
}

// sendEvent sends a node event, unless the client already has it: a replayed kind's
// event equal to the last one sent for its node is dropped, and a text delta is cut to
// the bytes beyond the node's text sent so far.
func (w *watcher) sendEvent(ev *meshv1.NodeEvent) error {
	if w.events < detailAll {
		return nil
	}
	id := ev.GetNodeId()
	switch {
	case replayed(ev):
		kept, ok := w.last[id]
		if ok || len(w.last) < maxRunningNodes {
			kind := reflect.TypeOf(ev.GetKind())
			for _, k := range kept {
				if reflect.TypeOf(k.GetKind()) == kind && proto.Equal(k, ev) {
					return nil
				}
			}
			w.last[id] = keepLatest(kept, ev)
		}
	case ev.GetText() != nil:
		d := ev.GetText()
		from, to := d.GetOffset(), d.GetOffset()+int64(len(d.GetText()))
		end, ok := w.textEnd[id]
		if ok && from < end {
			if to <= end {
				return nil // all of it sent already
			}
			cut := int(end - from)
			if !utf8.RuneStart(d.GetText()[cut]) { // not the text that was sent: pass it as it is
				break
			}
			ev = proto.Clone(ev).(*meshv1.NodeEvent)
			ev.GetText().Text, ev.GetText().Offset = d.GetText()[cut:], end
		}
		if ok || len(w.textEnd) < maxRunningNodes {
			w.textEnd[id] = max(end, to)
		}
	}
	return w.stream.Send(&orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_NodeEvent{NodeEvent: ev}})
}

// ownerTry is the owner a watch was last relayed from (or tried), and when that ended.
type ownerTry struct {
	owner string
	at    time.Time
}

// relayAddr returns the address to relay run's watch from: its owner's, when the store
// names a live owner other than this process with an address, and that owner was not
// tried within watchForwardRetry; "" otherwise.
func (s *Server) relayAddr(run store.Run, last ownerTry) string {
	addr := ownerAddr(run.Owner)
	if addr == "" || s.cfg.Peers == nil || run.Owner == s.cfg.Owner || !run.LeaseExpires.After(time.Now()) {
		return ""
	}
	if run.Owner == last.owner && time.Since(last.at) < watchForwardRetry {
		return ""
	}
	return addr
}

// relay passes the events of the owner's WatchRun of the run on to w, until the owner's
// stream ends. done is true when the watch is over: the summary was sent (err is the
// send's), the client left, this process is handing its runs over, or the client's
// stream failed. Otherwise the owner's stream ended without the summary, or the owner
// could not be reached: the caller looks the run up again.
func (s *Server) relay(ctx context.Context, run store.Run, addr string, w *watcher) (done bool, err error) {
	peer, err := s.cfg.Peers(addr)
	if err != nil {
		s.cfg.Log.DebugContext(ctx, "cannot reach the run's owner to relay a watch", "run_id", run.RunID, "owner", run.Owner, "error", err.Error())
		return false, nil
	}
	fctx, stop := context.WithCancel(ctx)
	defer stop()
	var opened atomic.Bool
	openTimer := time.AfterFunc(watchForwardOpen, func() {
		if !opened.Load() {
			stop()
		}
	})
	defer openTimer.Stop()
	go func() { // a stopping orchestrator's watches must not hold its stop
		select {
		case <-s.handedOver:
			stop()
		case <-fctx.Done():
		}
	}()

	st, err := peer.WatchRun(forwardedContext(fctx), &orchestratorv1.WatchRunRequest{RunId: run.RunID, Events: w.events.events()})
	for err == nil {
		var ev *orchestratorv1.WatchRunResponse
		if ev, err = st.Recv(); err != nil {
			break
		}
		opened.Store(true)
		var sendErr error
		switch e := ev.GetEvent().(type) {
		case *orchestratorv1.WatchRunResponse_Started:
			sendErr = w.sendStartedEvent(e.Started)
		case *orchestratorv1.WatchRunResponse_Node:
			sendErr = w.sendNode(e.Node)
		case *orchestratorv1.WatchRunResponse_NodeEvent:
			sendErr = w.sendEvent(e.NodeEvent)
		case *orchestratorv1.WatchRunResponse_Finished:
			return true, w.finish(e.Finished)
		}
		if sendErr != nil {
			return true, sendErr
		}
	}
	switch {
	case ctx.Err() != nil:
		return true, status.FromContextError(ctx.Err()).Err()
	case s.stopping():
		return true, drainingStatus("orchestrator is stopping; watch run " + run.RunID + " on another replica")
	}
	s.cfg.Log.DebugContext(ctx, "the run owner's watch ended without the run's summary; looking the run up again",
		"run_id", run.RunID, "owner", run.Owner, "code", status.Code(err).String())
	return false, nil
}

// stopping reports whether this process has handed its runs over (drain.go).
func (s *Server) stopping() bool {
	select {
	case <-s.handedOver:
		return true
	default:
		return false
	}
}

// notHeld is the answer to a forwarded WatchRun of a run this process does not hold:
// the relaying orchestrator looks the run up again rather than forward it once more.
func notHeld(id string) error {
	return status.Errorf(codes.Unavailable, "run %s is not held by this orchestrator", id)
}
