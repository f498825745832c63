package client

import (
	"context"
	"errors"
	"io"
	"iter"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// Request is a run to start.
type Request struct {
	// Task is the run's task; with the sim model, a JSON plan (docs/plan.md).
	Task string
	// Model is the model's name; "" is the service default ("sim").
	Model string
	// ContinueOnDisconnect (Run only) keeps the run going when its caller leaves. By
	// default a cancelled ctx, a Close of the Stream or of the Client cancels the run with
	// cause client_disconnect.
	ContinueOnDisconnect bool
	// Timeout (Start only; Run refuses it with INVALID_ARGUMENT) is the detached run's time
	// from now, capped at the service maximum. Zero makes the Start call's own ctx deadline
	// the run's (the service default, 30 s, when ctx has none), which is usually too short
	// for a detached run.
	Timeout time.Duration
	// Input is the rest of the run's input: its conversation, max_tokens, temperature,
	// response schema, tools, step limit and tool-error policy (docs/api.md, "A run's
	// input"); nil for none.
	Input *orchestratorv1.RunInput
	// Events (Run only) is what the stream carries between Started and Finished: every
	// node update and node event (RUN_EVENTS_ALL, the default), node updates only
	// (RUN_EVENTS_NODES), or nothing (RUN_EVENTS_SUMMARY). RunAndWait, which reads only
	// the summary, asks for the summary alone when Events is unset.
	Events orchestratorv1.RunEvents
}

// EventKind says which member of an Event is set.
type EventKind int

// The kinds of Event, in the order a run sends them: Started first, then Node and
// NodeEvent interleaved, Finished last.
const (
	EventStarted EventKind = iota + 1
	EventNode
	EventNodeEvent
	EventFinished
)

// Event is one event of a run's stream: exactly the member its Kind names is set.
type Event struct {
	Kind EventKind
	// Started: the run's id and absolute deadline.
	Started *orchestratorv1.RunStarted
	// Node: a node started, made progress or ended.
	Node *meshv1.Node
	// NodeEvent: something that happened inside a running node (docs/api.md#node-events).
	NodeEvent *meshv1.NodeEvent
	// Finished: the run's summary.
	Finished *orchestratorv1.Run
}

// temperature is in's temperature, nil when unset (or in is nil).
func temperature(in *orchestratorv1.RunInput) *float64 {
	if in == nil {
		return nil
	}
	return in.Temperature
}

// streamEvent is what RunResponse and WatchRunResponse have in common.
type streamEvent interface {
	GetStarted() *orchestratorv1.RunStarted
	GetNode() *meshv1.Node
	GetNodeEvent() *meshv1.NodeEvent
	GetFinished() *orchestratorv1.Run
}

// Stream is the events of one run, from Run or Watch. It is not safe for concurrent use.
// Read it to the end (Next returns an error) or Close it.
type Stream struct {
	recv    func() (streamEvent, error)
	cancel  context.CancelFunc
	first   *Event // the started event, read by Run and Watch, returned by the first Next
	runID   string
	summary *orchestratorv1.Run
	err     error // once set, what every further Next returns
}

// Next returns the stream's next event. After the Finished event it returns io.EOF when
// the call ended OK, or the call's gRPC status otherwise (for Run, the run's: for
// example DEADLINE_EXCEEDED or CANCELLED). A stream that fails before Finished returns its
// status. Event kinds this package does not know are skipped.
func (s *Stream) Next() (Event, error) {
	if s.first != nil {
		ev := *s.first
		s.first = nil
		return ev, nil
	}
	for s.err == nil {
		m, err := s.recv()
		if err != nil {
			s.err = err
			s.cancel()
			break
		}
		if ev, ok := s.event(m); ok {
			return ev, nil
		}
	}
	return Event{}, s.err
}

// event converts m, noting the run's id and summary; ok is false for an unknown kind.
func (s *Stream) event(m streamEvent) (Event, bool) {
	switch {
	case m.GetStarted() != nil:
		s.runID = m.GetStarted().GetRunId()
		return Event{Kind: EventStarted, Started: m.GetStarted()}, true
	case m.GetNode() != nil:
		return Event{Kind: EventNode, Node: m.GetNode()}, true
	case m.GetNodeEvent() != nil:
		return Event{Kind: EventNodeEvent, NodeEvent: m.GetNodeEvent()}, true
	case m.GetFinished() != nil:
		s.summary = m.GetFinished()
		return Event{Kind: EventFinished, Finished: m.GetFinished()}, true
	}
	return Event{}, false
}

// RunID returns the run's id, known once the stream has started.
func (s *Stream) RunID() string { return s.runID }

// Summary returns the run's summary once Next has returned the Finished event, nil
// before.
func (s *Stream) Summary() *orchestratorv1.Run { return s.summary }

// Close ends the call. For a Run stream whose run has not ended, that cancels the run with
// cause client_disconnect (unless ContinueOnDisconnect); leaving a Watch stream does not
// cancel the run. Close is safe to call more than once and after the end.
func (s *Stream) Close() {
	s.cancel()
	s.first = nil
	if s.err == nil {
		s.err = io.EOF
	}
}

// open reads a new stream's first event (the started event) so that Run and Watch fail
// themselves when the orchestrator refuses the call (UNAUTHENTICATED, a shed run, ...).
func open(cancel context.CancelFunc, recv func() (streamEvent, error)) (*Stream, error) {
	s := &Stream{recv: recv, cancel: cancel}
	ev, err := s.Next()
	if errors.Is(err, io.EOF) {
		err = status.Error(codes.Internal, "the orchestrator ended the stream before its first event")
	}
	if err != nil {
		cancel()
		return nil, err
	}
	s.first = &ev
	return s, nil
}

// Run starts a run and returns its stream once the run has started (the stream's first
// event, Started, is still returned by Next). ctx is the run's: its deadline is the run's
// absolute deadline (capped at the service maximum; the service default, 30 s, when ctx
// has none), and cancelling ctx cancels the run with cause client_disconnect, unless
// req.ContinueOnDisconnect.
//
// Run is retried (UNAVAILABLE, or a shed with RetryInfo) only until the run has started:
// never once the orchestrator has sent an event, since a retry would start a second run.
// Errors: see the package doc.
func (c *Client) Run(ctx context.Context, req Request) (*Stream, error) {
	if req.Timeout != 0 {
		return nil, status.Error(codes.InvalidArgument, "Request.Timeout is Start's: a Run's deadline is its ctx's (context.WithTimeout)")
	}
	ctx, cancel := context.WithCancel(ctx)
	in := req.Input
	st, err := c.rpc.Run(ctx, &orchestratorv1.RunRequest{Task: req.Task, Model: req.Model, ContinueOnDisconnect: req.ContinueOnDisconnect,
		Messages: in.GetMessages(), MaxTokens: in.GetMaxTokens(), Temperature: temperature(in), ResponseSchemaJson: in.GetResponseSchemaJson(),
		Tools: in.GetTools(), MaxSteps: in.GetMaxSteps(), ToolErrors: in.GetToolErrors(), Reserve: in.GetReserve(), Events: req.Events})
	if err != nil {
		cancel()
		return nil, err
	}
	return open(cancel, func() (streamEvent, error) { return st.Recv() })
}

// RunAndWait runs req (as Run) and returns the run's summary once it has ended. err is nil
// when the call ended OK; otherwise it is the call's status, returned with the summary when
// the run got that far (a run that failed, was cancelled or ran out of time), so that
// status.Code(err) and run.GetStatus() are both at hand.
func (c *Client) RunAndWait(ctx context.Context, req Request) (*orchestratorv1.Run, error) {
	if req.Events == orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED {
		req.Events = orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY // nothing else is read
	}
	s, err := c.Run(ctx, req)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	for {
		if _, err := s.Next(); err != nil {
			if errors.Is(err, io.EOF) {
				err = nil
			}
			return s.Summary(), err
		}
	}
}

// Watch follows a run started elsewhere (Start, another client) with the events Run sends;
// a run that has ended gets its Started and Finished events. Leaving it (Close, or
// cancelling ctx) does not cancel the run. Watch is retried like Run, until its first
// event.
func (c *Client) Watch(ctx context.Context, runID string) (*Stream, error) {
	ctx, cancel := context.WithCancel(ctx)
	st, err := c.rpc.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: runID})
	if err != nil {
		cancel()
		return nil, err
	}
	return open(cancel, func() (streamEvent, error) { return st.Recv() })
}

// Start starts a detached run and returns at once: the run as started, and created. With
// an idempotencyKey (1 to 256 printable ASCII characters, no spaces; scoped to the
// tenant), a Start whose key the tenant has used before starts nothing and returns that
// first run with created false, and Start is retried like any safe call; the same key with
// another task or model is ALREADY_EXISTS. Without a key Start is never retried, since a
// retry could start a second run. req.Timeout is the run's time (see Request).
func (c *Client) Start(ctx context.Context, req Request, idempotencyKey string) (run *orchestratorv1.Run, created bool, err error) {
	if req.Events != orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED {
		return nil, false, status.Error(codes.InvalidArgument, "Request.Events is Run's: Start streams nothing (Watch follows the run)")
	}
	in := req.Input
	r := &orchestratorv1.StartRunRequest{Task: req.Task, Model: req.Model, IdempotencyKey: idempotencyKey,
		Messages: in.GetMessages(), MaxTokens: in.GetMaxTokens(), Temperature: temperature(in), ResponseSchemaJson: in.GetResponseSchemaJson(),
		Tools: in.GetTools(), MaxSteps: in.GetMaxSteps(), ToolErrors: in.GetToolErrors(), Reserve: in.GetReserve()}
	if req.Timeout > 0 {
		r.Timeout = durationpb.New(req.Timeout)
	}
	if idempotencyKey != "" {
		// The retry layer retries a call with side effects only when it carries the key.
		ctx = metadata.AppendToOutgoingContext(ctx, md.IdempotencyKey, idempotencyKey)
	}
	resp, err := c.rpc.StartRun(ctx, r)
	if err != nil {
		return nil, false, err
	}
	return resp.GetRun(), resp.GetCreated(), nil
}

// Get returns a run and, once it has ended, its summary. Another tenant's run is
// NOT_FOUND, like one that does not exist.
func (c *Client) Get(ctx context.Context, runID string) (*orchestratorv1.Run, error) {
	resp, err := c.rpc.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: runID})
	if err != nil {
		return nil, err
	}
	return resp.GetRun(), nil
}

// Cancel cancels a run with cause operator, reason recorded with it, and returns the run
// once its tree has stopped. Cancelling a run that has ended returns it unchanged, so
// Cancel is safe to retry.
func (c *Client) Cancel(ctx context.Context, runID, reason string) (*orchestratorv1.Run, error) {
	resp, err := c.rpc.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: runID, Reason: reason})
	if err != nil {
		return nil, err
	}
	return resp.GetRun(), nil
}

// ListOptions selects a page of runs.
type ListOptions struct {
	// PageSize is the most runs on the page: 0 means 50; at most 500.
	PageSize int32
	// PageToken continues from a previous page's next token; "" is the first page. Pass
	// the same filters with it.
	PageToken string
	// Model, when set, lists only the runs started with this model.
	Model string
	// CreatedAfter and CreatedBefore, when set, list only the runs created in
	// [CreatedAfter, CreatedBefore): at or after the one, before the other.
	CreatedAfter, CreatedBefore time.Time
}

// request is the ListRunsRequest of o.
func (o ListOptions) request() *orchestratorv1.ListRunsRequest {
	req := &orchestratorv1.ListRunsRequest{PageSize: o.PageSize, PageToken: o.PageToken, Model: o.Model}
	if !o.CreatedAfter.IsZero() {
		req.CreatedAfter = timestamppb.New(o.CreatedAfter)
	}
	if !o.CreatedBefore.IsZero() {
		req.CreatedBefore = timestamppb.New(o.CreatedBefore)
	}
	return req
}

// List returns one page of the tenant's runs that opts selects, newest first, without
// their nodes, and the token of the next page ("" after the last).
func (c *Client) List(ctx context.Context, opts ListOptions) (runs []*orchestratorv1.Run, next string, err error) {
	resp, err := c.rpc.ListRuns(ctx, opts.request())
	if err != nil {
		return nil, "", err
	}
	return resp.GetRuns(), resp.GetNextPageToken(), nil
}

// Runs iterates over all of the tenant's runs, newest first, fetching pages of pageSize
// (0 means 50) as the loop goes. A failed page ends the loop with its error:
//
//	for run, err := range c.Runs(ctx, 0) {
//		if err != nil {
//			return err
//		}
//		...
//	}
func (c *Client) Runs(ctx context.Context, pageSize int32) iter.Seq2[*orchestratorv1.Run, error] {
	return func(yield func(*orchestratorv1.Run, error) bool) {
		opts := ListOptions{PageSize: pageSize}
		for {
			runs, next, err := c.List(ctx, opts)
			if err != nil {
				yield(nil, err)
				return
			}
			for _, r := range runs {
				if !yield(r, nil) {
					return
				}
			}
			if next == "" {
				return
			}
			opts.PageToken = next
		}
	}
}
