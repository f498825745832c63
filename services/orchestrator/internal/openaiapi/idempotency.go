package openaiapi

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// IdempotencyKeyHeader names a request's idempotency key: the run's. A request with one
// starts a detached run under the key (StartRun) and watches it (WatchRun), so that a
// retry of the request, by an SDK or by hand, attaches to the same run instead of
// starting the agent again. When the last request attached to such a run goes away
// before the run ends, and no request attaches to it within Config.DisconnectGrace, the
// run is cancelled with cause client_disconnect: a retry finds its run, an abandoned run
// stops spending.
const IdempotencyKeyHeader = "Idempotency-Key"

// DefaultDisconnectGrace is how long a keyed run whose clients all left waits for a
// retry to attach before it is cancelled: longer than the OpenAI SDKs' first retry
// delays (0.5 to 1 s with jitter), short enough that an abandoned run stops soon.
const DefaultDisconnectGrace = 2 * time.Second

// attached counts the requests attached to each keyed run of this front door, and holds
// the grace timer of a run none is attached to. It sees the requests of this process
// only: a retry that another orchestrator replica's front door serves does not stop
// this one's timer (docs/openai.md).
type attached struct {
	mu   sync.Mutex
	runs map[string]*watchers
}

type watchers struct {
	n     int
	grace *time.Timer // set while n is 0
}

// attach counts a request attached to run, stopping its grace timer if one runs.
func (a *attached) attach(run string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.runs == nil {
		a.runs = map[string]*watchers{}
	}
	w := a.runs[run]
	if w == nil {
		w = &watchers{}
		a.runs[run] = w
	}
	if w.grace != nil {
		w.grace.Stop()
		w.grace = nil
	}
	w.n++
}

// detach ends a request attached to run. With abandoned (the client left before the
// run ended) and no other request attached, cancel runs after grace unless a request
// attaches meanwhile.
func (a *attached) detach(run string, abandoned bool, grace time.Duration, cancel func()) {
	a.mu.Lock()
	defer a.mu.Unlock()
	w := a.runs[run]
	if w == nil {
		return
	}
	w.n--
	if w.n > 0 {
		return
	}
	if !abandoned {
		delete(a.runs, run)
		return
	}
	var t *time.Timer
	t = time.AfterFunc(grace, func() {
		a.mu.Lock()
		if w.grace != t { // a request attached meanwhile
			a.mu.Unlock()
			return
		}
		delete(a.runs, run)
		a.mu.Unlock()
		cancel()
	})
	w.grace = t
}

// abandon cancels the keyed run of a request whose client left, after the grace, unless
// a request attaches to it meanwhile; the cancel says the client left (md.CancelCause),
// so the run's cause is client_disconnect. ctx is the request's (its bearer key makes
// the CancelRun the tenant's).
func (h *Handler) abandon(ctx context.Context, run string) {
	h.keyed.detach(run, true, h.cfg.DisconnectGrace, func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cancelTimeout)
		defer cancel()
		cctx = metadata.AppendToOutgoingContext(cctx, md.CancelCause, md.CancelCauseClientDisconnect)
		_, err := h.cfg.Orchestrator.CancelRun(cctx, &orchestratorv1.CancelRunRequest{RunId: run,
			Reason: "OpenAI front door: the client left and did not retry within " + h.cfg.DisconnectGrace.String()})
		if err != nil {
			h.cfg.Log.WarnContext(ctx, "cancel of an abandoned keyed run failed", "run_id", run, "error", err.Error())
		}
	})
}

// cancelTimeout bounds the CancelRun of an abandoned run (it returns once the tree is
// down: milliseconds).
const cancelTimeout = 10 * time.Second

// events is a run's stream of events, Run's or WatchRun's.
type events func() (*orchestratorv1.RunResponse, error)

// open starts the run of req and returns its events: an attached Run without a key, a
// StartRun under key and a WatchRun of it with one. timeout is the request's time limit,
// 0 for none.
//
// A keyed run is attached until done is called, with whether the request's client
// left: then, with no other request attached, the grace begins (IdempotencyKeyHeader).
// done is a no-op without a key.
func (h *Handler) open(ctx context.Context, run *orchestratorv1.RunRequest, key string, timeout time.Duration) (_ events, done func(clientLeft bool), _ error) {
	done = func(bool) {}
	if key == "" {
		rs, err := h.cfg.Orchestrator.Run(ctx, run)
		if err != nil {
			return nil, done, err
		}
		return rs.Recv, done, nil
	}
	start := &orchestratorv1.StartRunRequest{Task: run.GetTask(), Model: run.GetModel(), IdempotencyKey: key,
		Messages: run.GetMessages(), MaxTokens: run.GetMaxTokens(), Temperature: run.Temperature,
		ResponseSchemaJson: run.GetResponseSchemaJson(), Tools: run.GetTools(), MaxSteps: run.GetMaxSteps(),
		ToolErrors: run.GetToolErrors(), Reserve: run.GetReserve()}
	if timeout > 0 {
		start.Timeout = durationpb.New(timeout)
	}
	res, err := h.cfg.Orchestrator.StartRun(ctx, start)
	if err != nil {
		return nil, done, err
	}
	id := res.GetRun().GetRunId()
	h.keyed.attach(id)
	done = func(clientLeft bool) {
		if clientLeft {
			h.abandon(ctx, id)
		} else {
			h.keyed.detach(id, false, 0, nil)
		}
	}
	ws, err := h.cfg.Orchestrator.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id, Events: run.GetEvents()})
	if err != nil {
		return nil, done, err
	}
	return func() (*orchestratorv1.RunResponse, error) {
		ev, err := ws.Recv()
		if err != nil {
			return nil, err
		}
		switch e := ev.GetEvent().(type) {
		case *orchestratorv1.WatchRunResponse_Started:
			return &orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Started{Started: e.Started}}, nil
		case *orchestratorv1.WatchRunResponse_Node:
			return &orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Node{Node: e.Node}}, nil
		case *orchestratorv1.WatchRunResponse_Finished:
			return &orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Finished{Finished: e.Finished}}, nil
		case *orchestratorv1.WatchRunResponse_NodeEvent:
			return &orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_NodeEvent{NodeEvent: e.NodeEvent}}, nil
		}
		return &orchestratorv1.RunResponse{}, nil
	}, done, nil
}
