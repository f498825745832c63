package openaiapi

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// IdempotencyKeyHeader names a request's idempotency key: the run's. A request with one
// starts a detached run under the key (StartRun) and watches it (WatchRun), so that a
// retry of the request, by an SDK or by hand, attaches to the same run instead of
// starting the agent again. Such a run goes on when its client leaves, until it ends or
// its deadline passes, so that the retry finds it; CancelRun stops it.
const IdempotencyKeyHeader = "Idempotency-Key"

// events is a run's stream of events, Run's or WatchRun's.
type events func() (*orchestratorv1.RunResponse, error)

// open starts the run of req and returns its events: an attached Run without a key, a
// StartRun under key and a WatchRun of it with one. timeout is the request's time limit,
// 0 for none.
func (h *Handler) open(ctx context.Context, run *orchestratorv1.RunRequest, key string, timeout time.Duration) (events, error) {
	if key == "" {
		rs, err := h.cfg.Orchestrator.Run(ctx, run)
		if err != nil {
			return nil, err
		}
		return rs.Recv, nil
	}
	start := &orchestratorv1.StartRunRequest{Task: run.GetTask(), Model: run.GetModel(), IdempotencyKey: key,
		Messages: run.GetMessages(), MaxTokens: run.GetMaxTokens(), Temperature: run.Temperature,
		ResponseSchemaJson: run.GetResponseSchemaJson(), Tools: run.GetTools(), MaxSteps: run.GetMaxSteps(),
		ToolErrors: run.GetToolErrors()}
	if timeout > 0 {
		start.Timeout = durationpb.New(timeout)
	}
	res, err := h.cfg.Orchestrator.StartRun(ctx, start)
	if err != nil {
		return nil, err
	}
	ws, err := h.cfg.Orchestrator.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: res.GetRun().GetRunId()})
	if err != nil {
		return nil, err
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
	}, nil
}
