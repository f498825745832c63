package toolrunner

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/idempotency"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
)

// Defaults of Config's zero fields.
const (
	DefaultMaxSubagentDepth  = 3
	DefaultMaxSubagentFanout = 32
	DefaultPollInterval      = 100 * time.Millisecond
)

// Config configures a Server.
type Config struct {
	// NodeRetention is how long a run's node records stay in memory after it ended
	// (nodes.DefaultRetention when 0).
	NodeRetention time.Duration
	// Subagent and SubagentNodes reach the subagent service (for spawn_subagent).
	Subagent      subagentv1.SubagentServiceClient
	SubagentNodes meshv1.NodeReportServiceClient
	// MaxSubagentDepth bounds nesting: a spawn that would make the depth exceed it fails
	// with FAILED_PRECONDITION. DefaultMaxSubagentDepth when 0.
	MaxSubagentDepth int
	// MaxSubagentFanout bounds concurrent subagents per run on this process; more fail
	// with RESOURCE_EXHAUSTED. DefaultMaxSubagentFanout when 0.
	MaxSubagentFanout int
	// SettleTimeout bounds the wait for a cancelled subagent's teardown;
	// cancel.DefaultSettleTimeout when 0.
	SettleTimeout time.Duration
	// Registerer, if set, receives the toolrunner's metrics.
	Registerer prometheus.Registerer
	// Store keeps the durable built-ins' records and effects (kv_put, notify); required.
	// Their effects are for other processes to read, so with a store no other process
	// shares (memory) those tools fail with FAILED_PRECONDITION. Owner names this
	// process incarnation in the records' leases (required); LeaseTTL is their lease
	// (idempotency.DefaultLeaseTTL when 0).
	Store    Store
	Owner    string
	LeaseTTL time.Duration
	// Tools, if set, runs the tools of the registry's sources: any name not a built-in's
	// goes to it (see registry.go). Without it such a name is NOT_FOUND.
	Tools *registry.Registry
	// ApprovalPoll is how often a call waiting for a human's approval reads its request
	// (approval.go); DefaultApprovalPoll when 0.
	ApprovalPoll time.Duration
}

// Store is what the server needs of a store: the tool records, the approval requests,
// and whether other processes share them.
type Store interface {
	store.Tools
	store.Approvals
	store.Sharing
}

// Server implements ToolRunnerService.
type Server struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	cfg   Config
	Nodes *nodes.Table
	jobs  *jobs
	keys  *keys
	idem  *idempotency.Executor
	// effects counts side effects actually performed, by tool.
	effects *prometheus.CounterVec
	// approvals counts the ends of approval waits, by outcome.
	approvals *prometheus.CounterVec

	mu     sync.Mutex
	fanout map[string]int // run → subagents in flight
}

// New returns a server. It panics without cfg.Store or cfg.Owner: a wiring bug.
func New(cfg Config) *Server {
	if cfg.MaxSubagentDepth == 0 {
		cfg.MaxSubagentDepth = DefaultMaxSubagentDepth
	}
	if cfg.MaxSubagentFanout == 0 {
		cfg.MaxSubagentFanout = DefaultMaxSubagentFanout
	}
	if cfg.SettleTimeout == 0 {
		cfg.SettleTimeout = cancel.DefaultSettleTimeout
	}
	s := &Server{cfg: cfg, Nodes: nodes.New(cfg.NodeRetention), fanout: map[string]int{}, jobs: newJobs(), keys: newKeys(),
		effects: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_tool_effects_total",
			Help: "Side effects tools actually performed (a deploy job started), by tool; a retry with an idempotency key adds none.",
		}, []string{"tool"})}
	s.effects.WithLabelValues("deploy") // the one built-in with side effects: exported at 0
	s.approvals = newApprovalsMetric()
	if cfg.Registerer != nil {
		cfg.Registerer.MustRegister(s.effects, s.approvals)
	}
	idem, err := idempotency.New(idempotency.Config{Store: cfg.Store, Owner: cfg.Owner, LeaseTTL: cfg.LeaseTTL})
	if err != nil {
		panic(err) // a missing Store or Owner: a wiring bug
	}
	s.idem = idem
	if cfg.Store.Shared() { // the durable built-ins run: exported at 0 too
		s.effects.WithLabelValues(plan.ToolKVPut)
		s.effects.WithLabelValues(plan.ToolNotify)
	}
	return s
}

// Report returns the NodeReportService of this server's tool nodes.
func (s *Server) Report() *nodes.Server { return &nodes.Server{Table: s.Nodes} }

// Execute implements ToolRunnerService.
func (s *Server) Execute(req *toolrunnerv1.ExecuteRequest, stream toolrunnerv1.ToolRunnerService_ExecuteServer) error {
	ctx := stream.Context()
	id := md.IdentityFrom(ctx)
	if id.RunID == "" || id.NodeID == "" {
		return status.Errorf(codes.InvalidArgument, "metadata %s and %s are required", md.RunID, md.NodeID)
	}
	var send sync.Mutex
	emit := func(n *meshv1.Node) {
		send.Lock()
		defer send.Unlock()
		_ = stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Node{Node: n}})
	}
	evs := &events{mu: &send, stream: stream, node: id.NodeID}
	exec, g, err := s.prepare(ctx, req, emit, evs.send)
	if err != nil {
		return err
	}
	if req.GetRequireApproval() && g.why == "" {
		g.why = registry.ApprovalPlan
	}
	if g.why != "" {
		// The wait runs as the tool's node, before the effect (approval.go).
		exec = s.gated(exec, g, req.GetName(), []byte(req.GetArgsJson()), evs.send)
	}
	if err := ctx.Err(); err != nil {
		return err // never start a tool for a call already cancelled
	}
	if k := md.IdempotencyKeyFrom(ctx); k != "" && !catalog.Durable(req.GetName()) && !md.HedgeFrom(ctx) {
		// (kv_put and notify keep their keys in the store, see durable.go.) A hedged
		// call's backup (curfew-hedge, only ever sent for tools without irreversible
		// effects) runs beside its twin instead of joining the twin's record.
		finish, rec := s.keys.claim(keyOf(ctx, k))
		if rec != nil {
			// Done: replay the stored result. In progress: join it. Either way, no second run.
			arrived := time.Now()
			out, err := s.keys.wait(ctx, rec)
			if md.IdentityFrom(ctx).Attempt > 1 {
				s.recordReplay(ctx, req.GetName(), arrived, err)
			}
			if err != nil {
				return err
			}
			send.Lock()
			defer send.Unlock()
			return stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Result{Result: &toolrunnerv1.ExecuteResult{OutputJson: out}}})
		}
		var out string
		outcome := status.Error(codes.Internal, "tool call ended without an outcome")
		defer func() { finish(out, outcome) }() // also when the tool panics
		out, outcome, err = s.execute(ctx, req, stream, exec, evs, &send)
		return err
	}
	_, _, err = s.execute(ctx, req, stream, exec, evs, &send)
	return err
}

// recordReplay records a caller's retry that an idempotency key answered (a reply lost
// after the tool ran) as the node's attempt, from its arrival to now with the replayed
// outcome: the node's attempts show the retry, though the tool did not run again. A
// duplicate of the same attempt (a second caller) is not a retry and is not recorded.
func (s *Server) recordReplay(ctx context.Context, name string, arrived time.Time, err error) {
	id := md.IdentityFrom(ctx)
	n := &meshv1.Node{Id: id.NodeID, Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: name, StartedAt: timestamppb.New(arrived)}
	if dl, ok := ctx.Deadline(); ok {
		n.Deadline = timestamppb.New(dl)
	}
	wctx, _ := s.Nodes.Begin(ctx, id.RunID, n)
	s.Nodes.Finish(wctx, id.RunID, id.NodeID, err, nil)
}

// execute runs a prepared tool call as a node and sends its result. It returns the
// tool's own outcome, which an idempotency key keeps (a tool that finished keeps its
// result even when the reply cannot reach the caller, so a retry replays it rather than
// running the tool again), and the call's error.
func (s *Server) execute(ctx context.Context, req *toolrunnerv1.ExecuteRequest, stream toolrunnerv1.ToolRunnerService_ExecuteServer,
	exec execFunc, evs *events, send *sync.Mutex) (out string, outcome, err error) {
	id := md.IdentityFrom(ctx)
	run, node := id.RunID, id.NodeID
	n := &meshv1.Node{Id: node, Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: req.GetName()}
	if dl, ok := ctx.Deadline(); ok {
		n.Deadline = timestamppb.New(dl)
	}
	// The tool's own node is recorded here, not streamed: the caller shows its own view, and
	// a stream with no message yet stays retryable. Only nested nodes (a subagent's) stream,
	// and node events, while the node runs: a tool that reported one is no longer retried.
	wctx, _ := s.Nodes.Begin(ctx, run, n)
	out, cleanup, err := exec(wctx)
	evs.end()
	cancelled := wctx.Err()
	s.Nodes.Finish(wctx, run, node, err, func(n *meshv1.Node) {
		if cancelled != nil {
			n.CancelledAt = timestamppb.Now()
		}
		n.Cleanup = cleanup
		if errors.Is(err, errApprovalTimeout) {
			n.Cause = meshv1.CancelCause_CANCEL_CAUSE_APPROVAL_TIMEOUT
		}
	})
	if err != nil {
		return "", err, err
	}
	if cancelled != nil {
		return out, nil, cancelled // finished as the call was cancelled: kept, not sent
	}
	send.Lock()
	defer send.Unlock()
	return out, nil, stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Result{Result: &toolrunnerv1.ExecuteResult{OutputJson: out}}})
}

// Sweep forgets old node records and idempotency records.
func (s *Server) Sweep(now time.Time) {
	s.Nodes.Sweep(now)
	s.keys.sweep(now, DefaultKeyRetention)
}

type execFunc func(ctx context.Context) (out string, cleanup *meshv1.Cleanup, err error)

// prepare validates the call (with the same rules as a plan's tool calls) and returns the
// function that runs it.
//
// emit streams the nodes beneath the tool; event streams node events (see events) until
// the tool's node ends.
func (s *Server) prepare(ctx context.Context, req *toolrunnerv1.ExecuteRequest, emit func(*meshv1.Node), event func(*meshv1.NodeEvent)) (execFunc, gate, error) {
	name, raw := req.GetName(), []byte(req.GetArgsJson())
	switch {
	case name == "":
		return nil, gate{}, status.Error(codes.InvalidArgument, "tool name is required")
	case !catalog.IsBuiltin(name) && s.cfg.Tools != nil:
		return s.prepareRegistry(ctx, name, raw, event)
	case !catalog.IsBuiltin(name):
		return nil, gate{}, status.Errorf(codes.NotFound, "unknown tool %q (built-ins: deploy, fail, kv_put, notify, sleep, spawn_subagent)", name)
	}
	exec, err := s.prepareBuiltin(ctx, name, raw, emit, event)
	// A built-in waits for approval only when its call asks (a plan's "approval": true).
	return exec, gate{minTime: builtinMinTime(name, raw)}, err
}

// prepareBuiltin is prepare for a built-in.
func (s *Server) prepareBuiltin(ctx context.Context, name string, raw []byte, emit func(*meshv1.Node), event func(*meshv1.NodeEvent)) (execFunc, error) {
	if err := plan.ValidateTool(name, raw); err != nil {
		var pe *plan.Error
		if errors.As(err, &pe) {
			return nil, status.Errorf(codes.InvalidArgument, "tool %s: %s: %s", name, pe.Path, pe.Msg)
		}
		return nil, status.Errorf(codes.InvalidArgument, "tool %s: %v", name, err)
	}
	if catalog.Durable(name) {
		return s.durable(name, raw), nil
	}
	switch name {
	case plan.ToolSleep:
		var a plan.SleepArgs
		_ = plan.Args(raw, &a) // validated above
		return func(ctx context.Context) (string, *meshv1.Cleanup, error) {
			if err := sleepReporting(ctx, a.MS, a.ProgressMS, event); err != nil {
				return "", nil, err
			}
			return fmt.Sprintf(`{"slept_ms":%d}`, a.MS), nil, nil
		}, nil
	case plan.ToolFail:
		var a plan.FailArgs
		_ = plan.Args(raw, &a)
		code := codes.Unavailable
		if a.Code != "" {
			code, _ = plan.ParseCode(a.Code)
		}
		times := max(a.Times, 1)
		if a.Rate > 0 {
			times = a.Times
		}
		fault := &plan.Fault{Attempts: times, Rate: a.Rate}
		return func(ctx context.Context) (string, *meshv1.Cleanup, error) {
			if err := sleep(ctx, time.Duration(a.AfterMS)*time.Millisecond); err != nil {
				return "", nil, err
			}
			attempt := max(md.IdentityFrom(ctx).Attempt, 1)
			if fault.Fails(attempt, rand.Float64) {
				if a.PushbackMS != nil {
					_ = grpc.SetTrailer(ctx, metadata.Pairs(retry.PushbackHeader, strconv.Itoa(*a.PushbackMS)))
				}
				st := status.Newf(code, "fail tool: injected failure on attempt %d of %d", attempt, times)
				if a.RetryInfoMS != nil {
					if d, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Duration(*a.RetryInfoMS) * time.Millisecond)}); err == nil {
						st = d
					}
				}
				return "", nil, st.Err()
			}
			return fmt.Sprintf(`{"attempt":%d}`, attempt), nil, nil
		}, nil
	case plan.ToolDeploy:
		var a plan.DeployArgs
		_ = plan.Args(raw, &a)
		return func(ctx context.Context) (string, *meshv1.Cleanup, error) { return s.deploy(ctx, a) }, nil
	default: // plan.ToolSpawnSubagent
		var a plan.SpawnArgs
		_ = plan.Args(raw, &a)
		if s.cfg.Subagent == nil {
			return nil, status.Error(codes.FailedPrecondition, "spawn_subagent: no subagent service configured")
		}
		depth := strings.Count(md.IdentityFrom(ctx).NodeID, "/sub") + 1
		if depth > s.cfg.MaxSubagentDepth {
			return nil, status.Errorf(codes.FailedPrecondition, "spawn_subagent: depth %d exceeds the limit %d", depth, s.cfg.MaxSubagentDepth)
		}
		// The nested loop takes its caller's tool-error policy, which the caller's loop
		// sends with the call (md.ToolErrors): it is the run's, not the model's to choose.
		toolErrors := subagentv1.ToolErrors_TOOL_ERRORS_TO_MODEL
		if md.ToolErrorsFailsRun(ctx) {
			toolErrors = subagentv1.ToolErrors_TOOL_ERRORS_FAIL_RUN
		}
		return func(ctx context.Context) (string, *meshv1.Cleanup, error) {
			return s.spawn(ctx, &subagentv1.SpawnRequest{Task: a.SpawnTask(), Model: a.Model, Tools: a.Tools,
				MaxTokens: a.MaxTokens, Reserve: a.Reserve, ToolErrors: toolErrors}, emit, event)

		}, nil
	}
}

// sleep waits d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// deploy starts a job, polls it until done, and on cancel aborts it on its own budget.
func (s *Server) deploy(ctx context.Context, a plan.DeployArgs) (string, *meshv1.Cleanup, error) {
	key := ""
	if k := md.IdempotencyKeyFrom(ctx); k != "" {
		key = keyOf(ctx, k)
	}
	jb, started, starts := s.jobs.start(key, time.Duration(a.DurationMS)*time.Millisecond)
	if started {
		s.effects.WithLabelValues(plan.ToolDeploy).Inc()
	}
	job, done := jb.id, jb.done
	if attempt := max(md.IdentityFrom(ctx).Attempt, 1); attempt <= a.FailAttempts {
		return "", nil, status.Errorf(codes.Unavailable, "deploy: job %d started but the acknowledgement was lost (injected, attempt %d of %d)", job, attempt, a.FailAttempts)
	}
	poll := time.Duration(a.PollMS) * time.Millisecond
	if poll <= 0 {
		poll = DefaultPollInterval
	}
	for polls := 1; ; polls++ {
		if !time.Now().Before(done) {
			return fmt.Sprintf(`{"job":%d,"status":"deployed","polls":%d,"starts":%d}`, job, polls, starts), nil, nil
		}
		if err := sleep(ctx, min(poll, time.Until(done))); err != nil {
			// Torn down mid-poll: abort the half-finished rollout on a budget of its own,
			// then re-raise the cancellation.
			budget := time.Duration(a.CleanupMS) * time.Millisecond
			if budget <= 0 {
				budget = cancel.DefaultCleanupBudget
			}
			c := &meshv1.Cleanup{Action: fmt.Sprintf("abort deploy job %d", job), StartedAt: timestamppb.Now(), Budget: durationpb.New(budget)}
			cerr := cancel.Cleanup(ctx, budget, func(cctx context.Context) error {
				return sleep(cctx, time.Duration(a.AbortMS)*time.Millisecond) // the abort call
			})
			c.EndedAt, c.Completed = timestamppb.Now(), cerr == nil
			if cerr != nil {
				c.Error = cerr.Error()
			}
			return "", c, err
		}
	}
}

// spawn runs a nested loop in the subagent service and forwards its nodes and node events.
func (s *Server) spawn(ctx context.Context, req *subagentv1.SpawnRequest, emit func(*meshv1.Node), event func(*meshv1.NodeEvent)) (string, *meshv1.Cleanup, error) {
	run := md.IdentityFrom(ctx).RunID
	s.mu.Lock()
	if s.fanout[run] >= s.cfg.MaxSubagentFanout {
		s.mu.Unlock()
		return "", nil, status.Errorf(codes.ResourceExhausted, "spawn_subagent: run already has %d subagents in flight (limit)", s.cfg.MaxSubagentFanout)
	}
	s.fanout[run]++
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		if s.fanout[run]--; s.fanout[run] <= 0 {
			delete(s.fanout, run)
		}
		s.mu.Unlock()
	}()
	st, err := s.cfg.Subagent.Spawn(ctx, req)
	if err != nil {
		return "", nil, s.settle(ctx, err)
	}
	var res *subagentv1.SpawnResult
	for {
		ev, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", nil, s.settle(ctx, err)
		}
		switch e := ev.GetEvent().(type) {
		case *subagentv1.SpawnResponse_Node:
			emit(e.Node)
		case *subagentv1.SpawnResponse_NodeEvent:
			event(e.NodeEvent)
		case *subagentv1.SpawnResponse_Result:
			res = e.Result
		}
	}
	return spawnOutput(res), nil, nil
}

// spawnOutput is spawn_subagent's result as the caller's model reads it: {"answer": ...},
// and for a subagent that ran out of time, "partial": true and a note saying what the
// answer is (docs/reserve.md).
func spawnOutput(res *subagentv1.SpawnResult) string {
	out := struct {
		Answer  string `json:"answer"`
		Partial bool   `json:"partial,omitempty"`
		Note    string `json:"note,omitempty"`
	}{Answer: res.GetAnswer(), Partial: res.GetPartial()}
	if out.Partial {
		out.Note = "the subagent ran out of time before it answered: this is what it had"
	}
	b, _ := json.Marshal(out)
	return string(b)
}

// settle waits for a cancelled subagent's teardown before the tool node ends. A subagent
// cancelled while this call is not is the run's cancel on its way here (the broadcast can
// reach the subagent first): it waits for that, bounded by cancel.AwaitWindow, so the tool
// node records the run's cause.
func (s *Server) settle(ctx context.Context, err error) error {
	cancel.Await(ctx, err)
	if ctx.Err() != nil && s.cfg.SubagentNodes != nil {
		_ = cancel.Settle(ctx, s.cfg.SubagentNodes, md.IdentityFrom(ctx).NodeID+"/sub", s.cfg.SettleTimeout)
	}
	return err
}
