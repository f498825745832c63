package orchestrator

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Limits of the public API.
const (
	// Paging limits of ListRuns.
	DefaultPageSize = 50
	MaxPageSize     = 500
	// maxKeyLen bounds an idempotency key.
	maxKeyLen = 256
	// watchPoll is how often WatchRun (and a CancelRun that waits for another
	// orchestrator's run to end) reads a run this process does not hold.
	watchPoll = 250 * time.Millisecond
)

// Run implements OrchestratorService.Run.
func (s *Server) Run(req *orchestratorv1.RunRequest, stream orchestratorv1.OrchestratorService_RunServer) error {
	ctx := stream.Context()
	events, err := detailOf(req.GetEvents())
	if err != nil {
		return err
	}
	st, err := s.start(ctx, startRequest{tenant: md.IdentityFrom(ctx).Tenant, model: req.GetModel(), task: req.GetTask(), attached: true, events: events,
		input: runInput(req.GetMessages(), req.GetMaxTokens(), req.Temperature, req.GetResponseSchemaJson(), req.GetTools(),
			req.GetMaxSteps(), req.GetToolErrors(), req.GetReserve())})
	if err != nil {
		return err
	}
	rn, sub := st.rn, st.sub
	defer rn.unsubscribe(sub)
	if c := md.IdentityFrom(ctx).Chaos; c != "" {
		// Tells a drill that this orchestrator honours its chaos settings (--chaos).
		_ = stream.SetHeader(metadata.Pairs(md.Chaos, c))
	}
	if err := stream.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Started{Started: &orchestratorv1.RunStarted{
		RunId: rn.id, Deadline: timestamppb.New(rn.dl)}}}); err != nil {
		s.disconnected(ctx, rn, req)
		return err
	}
	if events >= detailNodes {
		if err := stream.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Node{Node: st.root}}); err != nil {
			s.disconnected(ctx, rn, req)
			return err
		}
	}
	for {
		select {
		case ev := <-sub:
			if err := stream.Send(ev); err != nil {
				s.disconnected(ctx, rn, req)
				return err
			}
		case <-rn.done:
			for more := true; more; {
				select {
				case ev := <-sub:
					if err := stream.Send(ev); err != nil {
						return err
					}
				default:
					more = false
				}
			}
			if err := rn.movedErr(); err != nil {
				return err
			}
			run := rn.snapshot(s.shared)
			if err := stream.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Finished{Finished: run}}); err != nil {
				return err
			}
			return runErr(run)
		case <-ctx.Done():
			s.disconnected(ctx, rn, req)
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// StartRun implements OrchestratorService.StartRun.
func (s *Server) StartRun(ctx context.Context, req *orchestratorv1.StartRunRequest) (*orchestratorv1.StartRunResponse, error) {
	key := req.GetIdempotencyKey()
	if key == "" {
		key = md.IdempotencyKeyFrom(ctx)
	}
	if len(key) > maxKeyLen {
		return nil, status.Errorf(codes.InvalidArgument, "idempotency_key is longer than %d bytes", maxKeyLen)
	}
	var timeout time.Duration
	if req.GetTimeout() != nil {
		if err := req.GetTimeout().CheckValid(); err != nil || req.GetTimeout().AsDuration() <= 0 {
			return nil, status.Error(codes.InvalidArgument, "timeout must be a positive duration")
		}
		timeout = req.GetTimeout().AsDuration()
	}
	in := runInput(req.GetMessages(), req.GetMaxTokens(), req.Temperature, req.GetResponseSchemaJson(), req.GetTools(),
		req.GetMaxSteps(), req.GetToolErrors(), req.GetReserve())
	r, created, err := s.startDetached(ctx, key, req.GetModel(), req.GetTask(), in, timeout)
	if err != nil {
		return nil, err
	}
	return &orchestratorv1.StartRunResponse{Run: r, Created: created}, nil
}

// ReplayPayload is a run's dead-letter payload: what replaying it starts again.
type ReplayPayload struct {
	Task  string `json:"task"`
	Model string `json:"model,omitempty"`
	// Input is the run's encoded RunInput, if it had one.
	Input []byte `json:"input,omitempty"`
}

// Replay starts a dead letter's payload as a new detached run, idempotently on key: the
// Replayer of the DeadLetterService.
func (s *Server) Replay(ctx context.Context, key string, payload []byte, timeout time.Duration) (string, bool, error) {
	var p ReplayPayload
	if err := json.Unmarshal(payload, &p); err != nil || p.Task == "" && len(p.Input) == 0 {
		return "", false, status.Error(codes.FailedPrecondition, "the dead letter's payload is not a run this service can replay")
	}
	if timeout == 0 {
		timeout = s.cfg.MaxRunTime
		if dl, ok := ctx.Deadline(); ok {
			// The service default, as a run started without a timeout would get it.
			timeout = min(timeout, max(time.Until(dl), s.cfg.MinRunTime))
		}
	}
	r, created, err := s.startDetached(ctx, key, p.Model, p.Task, decodeInput(p.Input), timeout)
	if err != nil {
		return "", false, err
	}
	return r.GetRunId(), created, nil
}

// startDetached starts a run that no call follows (StartRun, Replay) and returns it, or
// the existing run that key names (created false).
func (s *Server) startDetached(ctx context.Context, key, model, task string, in *orchestratorv1.RunInput, timeout time.Duration) (*orchestratorv1.Run, bool, error) {
	st, err := s.start(ctx, startRequest{tenant: md.IdentityFrom(ctx).Tenant, key: key, model: model, task: task, input: in, timeout: timeout})
	if err != nil || st.rn == nil {
		return st.existing, false, err
	}
	return st.rn.snapshot(s.shared), true, nil
}

// WatchRun implements OrchestratorService.WatchRun: a run this process holds is followed
// through its events; one another orchestrator owns is relayed from its owner
// (watchfwd.go), or polled in the store when the owner cannot be reached.
func (s *Server) WatchRun(req *orchestratorv1.WatchRunRequest, stream orchestratorv1.OrchestratorService_WatchRunServer) error {
	ctx := stream.Context()
	id := req.GetRunId()
	if id == "" {
		return status.Error(codes.InvalidArgument, "run_id is required")
	}
	events, err := detailOf(req.GetEvents())
	if err != nil {
		return err
	}
	w := newWatcher(stream, events)
	forwarded := forwardedCall(ctx)
	var last ownerTry
	for {
		if rn, err := s.visible(ctx, id); err == nil {
			sub := rn.subscribe(events)
			err := s.follow(ctx, rn, sub, w)
			rn.unsubscribe(sub)
			if err != nil {
				return err
			}
			if !rn.moved() {
				return w.finish(rn.snapshot(s.shared))
			}
		}
		run, err := s.cfg.Store.GetRun(ctx, md.IdentityFrom(ctx).Tenant, id)
		if err != nil {
			return runStoreErr(ctx, s.cfg.Log, "get run", id, err)
		}
		if apiStatusOf(run.Status) != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return w.finish(s.fromStore(ctx, run))
		}
		if forwarded {
			return notHeld(id)
		}
		if err := w.sendStarted(s.fromStore(ctx, run)); err != nil {
			return err
		}
		if addr := s.relayAddr(run, last); addr != "" && !s.stopping() {
			done, err := s.relay(ctx, run, addr, w)
			if done {
				return err
			}
			last = ownerTry{owner: run.Owner, at: time.Now()}
			continue // look the run up again at once
		}
		t := time.NewTimer(watchPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return status.FromContextError(ctx.Err()).Err()
		case <-s.handedOver:
			// Stopping: the watch of a run that goes on elsewhere must not hold the stop.
			t.Stop()
			return drainingStatus(fmt.Sprintf("orchestrator is stopping; watch run %s on another replica", id))
		case <-t.C:
		}
	}
}

// follow streams a local run's events to w until the run ends here.
func (s *Server) follow(ctx context.Context, rn *run, sub chan *orchestratorv1.RunResponse, w *watcher) error {
	if err := w.sendStarted(rn.snapshot(s.shared)); err != nil {
		return err
	}
	send := func(ev *orchestratorv1.RunResponse) error {
		switch e := ev.GetEvent().(type) {
		case *orchestratorv1.RunResponse_Node:
			return w.sendNode(e.Node)
		case *orchestratorv1.RunResponse_NodeEvent:
			return w.sendEvent(e.NodeEvent)
		}
		return nil
	}
	for {
		select {
		case ev := <-sub:
			if err := send(ev); err != nil {
				return err
			}
		case <-rn.done:
			for {
				select {
				case ev := <-sub:
					if err := send(ev); err != nil {
						return err
					}
				default:
					return nil
				}
			}
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// GetRun implements OrchestratorService.GetRun. A running run's nodes are read live.
func (s *Server) GetRun(ctx context.Context, req *orchestratorv1.GetRunRequest) (*orchestratorv1.GetRunResponse, error) {
	rn, err := s.visible(ctx, req.GetRunId())
	if err != nil {
		if status.Code(err) != codes.NotFound {
			return nil, err
		}
		r, err := s.stored(ctx, req.GetRunId())
		if err != nil {
			return nil, err
		}
		return &orchestratorv1.GetRunResponse{Run: r}, nil
	}
	if rn.ended() {
		return &orchestratorv1.GetRunResponse{Run: rn.snapshot(s.shared)}, nil
	}
	r := rn.snapshot(s.shared)
	if r.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
		// Live: read the nodes from the executors. A run whose end is recorded but not yet
		// committed (its result is being stored) already holds its final summary, with
		// the token figures split at the cancel instant: a live read would lose the split.
		rn.mu.Lock()
		reaches := rn.reaches
		rn.mu.Unlock()
		setNodes(r, s.collect(ctx, rn.id, reaches, time.Time{}, 0))
	}
	return &orchestratorv1.GetRunResponse{Run: r}, nil
}

// ListRuns implements OrchestratorService.ListRuns: the caller's tenant's runs, newest
// first, without nodes, filtered by model and creation window. The page token is the id
// of the last run of the previous page; run ids are UUIDv7, ordered by creation, so
// pages stay stable while new runs arrive, whatever the filters.
func (s *Server) ListRuns(ctx context.Context, req *orchestratorv1.ListRunsRequest) (*orchestratorv1.ListRunsResponse, error) {
	size, after, err := pageOf(req, DefaultPageSize, MaxPageSize)
	if err != nil {
		return nil, err
	}
	q, err := runFilters(req)
	if err != nil {
		return nil, err
	}
	q.Tenant, q.After, q.Limit = md.IdentityFrom(ctx).Tenant, after, size
	return s.listStored(ctx, q)
}

// runFilters reads ListRuns' filters into a store query: INVALID_ARGUMENT for a
// timestamp out of range or a window that ends before it starts.
func runFilters(req *orchestratorv1.ListRunsRequest) (store.RunQuery, error) {
	q := store.RunQuery{Model: req.GetModel()}
	for _, b := range []struct {
		name string
		ts   *timestamppb.Timestamp
		to   *time.Time
	}{{"created_after", req.GetCreatedAfter(), &q.CreatedAfter}, {"created_before", req.GetCreatedBefore(), &q.CreatedBefore}} {
		if b.ts == nil {
			continue
		}
		if err := b.ts.CheckValid(); err != nil {
			return q, status.Errorf(codes.InvalidArgument, "%s: %v", b.name, err)
		}
		*b.to = b.ts.AsTime()
	}
	if !q.CreatedAfter.IsZero() && !q.CreatedBefore.IsZero() && q.CreatedAfter.After(q.CreatedBefore) {
		return q, status.Errorf(codes.InvalidArgument, "created_after (%s) is after created_before (%s)",
			q.CreatedAfter.Format(time.RFC3339Nano), q.CreatedBefore.Format(time.RFC3339Nano))
	}
	return q, nil
}

// pageOf reads a list request's page: its size (0: def; above most: most; negative:
// INVALID_ARGUMENT) and the id after which it starts ("": the first page), which must
// be a UUID, as every id this service issues is.
func pageOf(req interface {
	GetPageSize() int32
	GetPageToken() string
}, def, most int) (size int, after string, err error) {
	size = int(req.GetPageSize())
	switch {
	case size < 0:
		return 0, "", status.Error(codes.InvalidArgument, "page_size must not be negative")
	case size == 0:
		size = def
	case size > most:
		size = most
	}
	after = req.GetPageToken()
	if after != "" {
		if _, err := uuid.Parse(after); err != nil {
			return 0, "", status.Error(codes.InvalidArgument, "page_token is not one this service issued")
		}
	}
	return size, after, nil
}

// CancelRun implements OrchestratorService.CancelRun: it cancels the run with cause
// operator and returns once its tree has been torn down. Cancelling an ended run returns
// it unchanged. A run another orchestrator holds is cancelled through it (cancelfwd.go).
func (s *Server) CancelRun(ctx context.Context, req *orchestratorv1.CancelRunRequest) (*orchestratorv1.CancelRunResponse, error) {
	rn, err := s.visible(ctx, req.GetRunId())
	if err != nil {
		if status.Code(err) != codes.NotFound {
			return nil, err
		}
		r, err := s.cancelElsewhere(ctx, req)
		if err != nil {
			return nil, err
		}
		return &orchestratorv1.CancelRunResponse{Run: r}, nil
	}
	r, err := s.cancelHere(ctx, rn, req)
	if err != nil {
		return nil, err
	}
	return &orchestratorv1.CancelRunResponse{Run: r}, nil
}
