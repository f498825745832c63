package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/decoderlease"
	"github.com/curfew-mesh/curfew/mesh/hedge"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/toollist"
)

// Defaults of Config's zero fields.
const (
	DefaultModel        = "sim"
	DefaultMinModelTime = 50 * time.Millisecond
	DefaultMinToolTime  = 10 * time.Millisecond
	DefaultMaxSteps     = 64
	DefaultMaxFanout    = 16
	// emitEvery throttles token progress events of a model node.
	emitEvery = 100 * time.Millisecond
)

// Config wires a Loop to the services it calls. Model and Tools are required.
type Config struct {
	Model      modelproxyv1.ModelProxyServiceClient
	ModelNodes meshv1.NodeReportServiceClient // modelproxy's node report, to settle cancelled decoders
	Tools      toolrunnerv1.ToolRunnerServiceClient
	ToolNodes  meshv1.NodeReportServiceClient // toolrunner's node report, to settle cancelled tools
	// Notes records the causes this loop cancels children with (sibling_failed).
	Notes *nodes.Table
	// ModelName is the model of every step; DefaultModel when empty.
	ModelName string
	// MinModelTime is the least time left to start a model call; DefaultMinModelTime when 0.
	MinModelTime time.Duration
	// MinToolTime is the least time left to start a tool; DefaultMinToolTime when 0.
	MinToolTime time.Duration
	// MaxSteps bounds the model steps of one loop; DefaultMaxSteps when 0.
	MaxSteps int
	// MaxFanout is the most tool calls one step may make (they all run in parallel); a step
	// asking for more fails with INVALID_ARGUMENT. DefaultMaxFanout when 0.
	MaxFanout int
	// PartialMargin is how long before its deadline a loop with Input.Partial stops;
	// DefaultPartialMargin when 0.
	PartialMargin time.Duration
	// SettleTimeout bounds the wait for a cancelled child's teardown;
	// cancel.DefaultSettleTimeout when 0. It covers the default cleanup budget of a tool.
	SettleTimeout time.Duration
	// Emit, if set, receives progress: model nodes as their tokens arrive, and the nodes
	// the tools report. It is called from several goroutines.
	Emit func(*meshv1.Node)
	// EmitEvent, if set, receives the node events the tools stream: their own and those of
	// the nodes beneath them (a subagent's), whatever their kind, in the order each tool
	// sent them: after Emit got that tool node's start and before it gets its end. An
	// event naming a node outside the tool's subtree is dropped. It also receives the
	// loop's own model nodes' text, a TextDelta for every chunk of text as it arrives,
	// in the same way between the node's start and end. It is called from several
	// goroutines.
	EmitEvent func(*meshv1.NodeEvent)
	// Leases renews the leases of the decoders this loop streams from (docs/leases.md).
	// When nil, New takes the process-wide keeper of Model with LeaseOptions
	// (decoderlease.Shared), so every loop of the process renews in the same calls.
	Leases *decoderlease.Keeper
	// LeaseOptions configure that keeper when Leases is nil: its renewal period and the
	// TTL it asks for. Zero fields take decoderlease's defaults (4 s, 3 × the period).
	LeaseOptions decoderlease.Options
	// ToolList tells each model step of the tools its tenant may call (toolrunner's
	// ListTools, kept per tenant for a few seconds: see package toollist), and decides
	// from their listed side effects whether a failed tool call may be retried without an
	// idempotency key. When toolrunner does not answer, the model is told of the
	// built-ins, and the run goes on. When nil, New takes the process-wide lister of
	// Tools (toollist.Shared).
	ToolList *toollist.Lister
	// Hedge, when set, sends a hedged backup of a slow tool call (package mesh/hedge): only
	// for tools whose side effects are none or idempotent and which run no model calls
	// (toollist.Tools.Hedgeable). Model calls are never hedged: this is the only path
	// that uses it. Nil: no hedging.
	Hedge *hedge.Policy
}

// HedgeNode is the node a hedged tool call's backup runs as, beneath the tool's node:
// run cancels of the tool's node reach it, and its record never replaces its twin's.
const HedgeNode = "hedge"

// Loop runs agent loops. It is safe for concurrent use.
type Loop struct{ cfg Config }

// New returns a Loop with cfg's zero fields defaulted.
func New(cfg Config) *Loop {
	if cfg.ModelName == "" {
		cfg.ModelName = DefaultModel
	}
	if cfg.MinModelTime == 0 {
		cfg.MinModelTime = DefaultMinModelTime
	}
	if cfg.MinToolTime == 0 {
		cfg.MinToolTime = DefaultMinToolTime
	}
	if cfg.MaxSteps == 0 {
		cfg.MaxSteps = DefaultMaxSteps
	}
	if cfg.MaxFanout == 0 {
		cfg.MaxFanout = DefaultMaxFanout
	}
	if cfg.SettleTimeout == 0 {
		cfg.SettleTimeout = cancel.DefaultSettleTimeout
	}
	if cfg.PartialMargin == 0 {
		cfg.PartialMargin = DefaultPartialMargin
	}
	if cfg.Emit == nil {
		cfg.Emit = func(*meshv1.Node) {}
	}
	if cfg.EmitEvent == nil {
		cfg.EmitEvent = func(*meshv1.NodeEvent) {}
	}
	if cfg.Leases == nil && cfg.Model != nil {
		cfg.Leases = decoderlease.Shared(cfg.Model, cfg.LeaseOptions)
	}
	if cfg.ToolList == nil && cfg.Tools != nil {
		cfg.ToolList = toollist.Shared(cfg.Tools)
	}
	return &Loop{cfg: cfg}
}

// Tools returns the tools of ctx's tenant as the loop's model steps are told of them
// (the built-ins without a lister, or when toolrunner does not answer): their
// NeedsKey says whether a call of one may run again without an idempotency key.
func (l *Loop) Tools(ctx context.Context) *toollist.Tools {
	if l.cfg.ToolList == nil {
		return toollist.Builtins()
	}
	return l.cfg.ToolList.Tools(ctx)
}

// Input is what one loop runs with.
type Input struct {
	// Model overrides the configured model when not empty.
	Model string
	// Messages are the conversation before Task (a system message first, if any).
	Messages []*modelproxyv1.Message
	// Task, when not empty, is the last user message.
	Task string
	// MaxTokens, Temperature and ResponseSchema go with every model step: the bound on
	// its output tokens (0: the provider's default), its sampling temperature (nil: the
	// provider's default), and the JSON Schema its answer must satisfy (empty: none).
	MaxTokens      int32
	Temperature    *float64
	ResponseSchema string
	// Tools, when not empty, are the names of the tools the loop may use, among those of
	// the tenant: the model is told of those only, and a call of another fails as an
	// unknown tool (NOT_FOUND).
	Tools []string
	// MaxSteps bounds the model steps; Config.MaxSteps when 0.
	MaxSteps int
	// Reserve is the time the loop keeps for its final answer (docs/reserve.md): a
	// duration, or a fraction of the time left when it starts. Its tools and subagents
	// run under its deadline minus the reserve, so a child's deadline is never later; and
	// when another round of tools (about as long as the last one took) cannot end before
	// the reserve, the model is asked for its final answer without tools. The zero
	// Reserve keeps none: the loop then works until its deadline.
	Reserve plan.Reserve
	// Partial makes a loop that runs out of time return what it has as a partial answer
	// (Result.Partial) rather than DEADLINE_EXCEEDED: it stops Config.PartialMargin before
	// its deadline, so that the answer still reaches its caller. A cancel is still a
	// cancel. The subagent service sets it: a child out of time does not fail its parent.
	Partial bool
	// FailOnToolError makes a failed tool call fail the loop. Otherwise the error goes
	// back to the model as the tool's result, {"error": "<message>"}, and the loop goes
	// on, except with the sim model (whose plan's failing step fails the loop), and for a
	// tool stopped by the loop's own cancellation or deadline.
	FailOnToolError bool
}

// Run runs the loop for task under ctx (which carries the run's identity and absolute
// deadline). base is the node id of the loop's owner ("root" for a run); model steps are
// base/m<i> and tools base/s<i>.t<j>. model overrides the configured model when not empty.
// It returns the answer, or a gRPC status error.
func (l *Loop) Run(ctx context.Context, base, model, task string) (string, error) {
	return l.RunJournaled(ctx, base, model, task, nil)
}

// RunJournaled is RunInput with only a model and a task, a failed tool failing the loop.
func (l *Loop) RunJournaled(ctx context.Context, base, model, task string, j Journal) (string, error) {
	return l.RunInput(ctx, base, Input{Model: model, Task: task, FailOnToolError: true}, j)
}

// RunInput is RunResult for a loop without Input.Partial: its answer, or a gRPC status
// error.
func (l *Loop) RunInput(ctx context.Context, base string, in Input, j Journal) (string, error) {
	r, err := l.RunResult(ctx, base, in, j)
	return r.Answer, err
}

// RunResult runs the loop for in with a journal: it first replays the entries an earlier
// incarnation of the loop recorded (a completed model step is not generated again,
// completed tools are not called again), then records every model step and every step's
// tool results as they complete, before going on. A Record error stops the loop with that
// error. A nil journal records nothing.
//
// The loop keeps in.Reserve for its final answer (docs/reserve.md): its tools and
// subagents run under its deadline minus the reserve, every model step is told the time
// left in a note after the conversation, and once another round of tools cannot end
// before the reserve, the model is asked for its final answer without tools. With
// in.Partial, a loop that runs out of time returns what it has (Result.Partial).
func (l *Loop) RunResult(ctx context.Context, base string, in Input, j Journal) (Result, error) {
	model := in.Model
	if model == "" {
		model = l.cfg.ModelName
	}
	var prior []Entry
	if j != nil {
		prior = j.Replay()
	}
	next := func(step int, kind EntryKind) *Entry { // the recorded entry for (step, kind), if any
		if len(prior) == 0 || prior[0].Step != step || prior[0].Kind != kind {
			return nil
		}
		e := &prior[0]
		prior = prior[1:]
		return e
	}
	record := func(e Entry) error {
		if j == nil {
			return nil
		}
		return j.Record(ctx, e)
	}
	msgs := slices.Clip(in.Messages)
	if in.Task != "" {
		msgs = append(msgs, &modelproxyv1.Message{Role: modelproxyv1.Role_ROLE_USER, Content: in.Task})
	}
	maxSteps := in.MaxSteps
	if maxSteps <= 0 {
		maxSteps = l.cfg.MaxSteps
	}
	// The loop's instants: lctx ends when it must have answered, tctx when its tools must
	// have (the reserve before). Both are ctx itself when there is nothing to cut.
	at := loopTimes(ctx, in.Reserve, in.Partial, l.cfg.PartialMargin, time.Now())
	lctx, tctx := ctx, ctx
	if in.Partial && !at.end.IsZero() {
		var stop context.CancelFunc
		lctx, stop = context.WithDeadline(ctx, at.end)
		defer stop()
		tctx = lctx
	}
	if at.reserve {
		var stop context.CancelFunc
		tctx, stop = context.WithDeadline(lctx, at.tools)
		defer stop()
	}
	var got have // what the loop has, for a partial answer
	// outOfTime ends a loop with err: when lctx ended (or a callee's copy of its deadline
	// fired a moment before it), with in.Partial and ctx itself alive (the loop ran out of
	// its own time, not cancelled), what it has is its answer.
	outOfTime := func(err error) (Result, error) {
		if in.Partial && ctx.Err() == nil && (lctx.Err() != nil || atDeadline(lctx, err)) {
			return Result{Answer: got.answer(), Partial: true}, nil //nolint:nilerr // out of its own time, the loop answers with what it has
		}
		return Result{}, err
	}
	// Tool errors go back to a real model; the sim model's plan has no use for them.
	pol := toolPolicy{toModel: !in.FailOnToolError && model != DefaultModel, allowed: in.Tools, failRun: in.FailOnToolError}
	if model == DefaultModel {
		// A sim plan's step may ask for a human's approval of a call ("approval": true).
		pol.approval = plan.Approvals(in.Task)
	}
	final := false          // the model is asked for its final answer, without tools
	var round time.Duration // how long the last round (model step and tools) took
	minRound := l.cfg.MinModelTime + l.cfg.MinToolTime
	for i := 0; i < maxSteps; i++ {
		if err := lctx.Err(); err != nil {
			return outOfTime(cancel.Status(lctx))
		}
		started := time.Now()
		final = final || at.toolTimeUp(started, max(round, minRound))
		var res *stepResult
		var tools *toollist.Tools // what the step's model was told of; its tool calls are judged by it
		if e := next(i, EntryModel); e != nil {
			res = &stepResult{GenerateResponse: &modelproxyv1.GenerateResponse{
				FinishReason: e.FinishReason, ToolCalls: e.ToolCalls}, text: e.Text}
		} else {
			if len(prior) > 0 {
				return Result{}, status.Errorf(codes.Internal, "journal of %s does not match the loop: entry %d of step %d (%s) where step %d's model output belongs",
					base, prior[0].Seq, prior[0].Step, prior[0].Kind, i)
			}
			var err error
			res, tools, err = l.modelStep(lctx, ModelStepID(base, i), model, msgs, &in, at.timeNote(started, final), final)
			if err != nil {
				if res != nil {
					got.addText(res.text)
				}
				return outOfTime(err)
			}
			if err := record(Entry{Step: i, Kind: EntryModel, Text: res.text, FinishReason: res.GetFinishReason(),
				ToolCalls: res.GetToolCalls(), Tokens: res.tokens}); err != nil {
				return Result{}, err
			}
		}
		got.addText(res.text)
		// The step answers unless it asked for tools. A step may think without calling
		// any tool (finish reason "tool_calls" with none, as the sim model sends for a
		// plan step without tools): the loop then goes on to the next step.
		if len(res.GetToolCalls()) == 0 && res.GetFinishReason() != "tool_calls" {
			return Result{Answer: res.text}, nil
		}
		if final {
			// Asked for its final answer, the model asked for tools again: its text, if
			// any, is the answer; there is no time to run them.
			if strings.TrimSpace(res.text) != "" {
				return Result{Answer: res.text}, nil
			}
			return outOfTime(status.Errorf(codes.DeadlineExceeded,
				"%s: the time for tools is up (reserve), and the model asked for tools instead of answering", base))
		}
		calls := res.GetToolCalls() // res (the step's last chunk) is not kept while its tools run
		msgs = append(msgs, &modelproxyv1.Message{Role: modelproxyv1.Role_ROLE_ASSISTANT, Content: res.text, ToolCalls: calls})
		var outs []string
		if e := next(i, EntryTools); e != nil && len(e.ToolOutputs) == len(calls) {
			outs = e.ToolOutputs
		} else {
			if e != nil || len(prior) > 0 {
				return Result{}, status.Errorf(codes.Internal, "journal of %s does not match the loop at step %d's tool results", base, i)
			}
			if tools == nil { // the model step was replayed
				tools = l.Tools(ctx).Only(in.Tools)
			}
			if at.reserve && tctx.Err() != nil {
				// The model step ended past the reserve: its tools have no time to run.
				outs = make([]string, len(calls))
				for j, c := range calls {
					outs[j] = reserveResult(c.GetName(), false)
				}
			} else {
				var err error
				outs, err = l.toolStep(lctx, tctx, fmt.Sprintf("%s/s%d", base, i), calls, tools, pol)
				if err != nil {
					return outOfTime(err)
				}
			}
			if err := record(Entry{Step: i, Kind: EntryTools, ToolOutputs: outs}); err != nil {
				return Result{}, err
			}
		}
		got.setTools(calls, outs)
		for j, c := range calls {
			msgs = append(msgs, &modelproxyv1.Message{Role: modelproxyv1.Role_ROLE_TOOL, ToolCallId: c.GetId(), Content: outs[j]})
		}
		round = time.Since(started)
	}
	return Result{}, status.Errorf(codes.ResourceExhausted, "step limit %d reached", maxSteps)
}

type stepResult struct {
	*modelproxyv1.GenerateResponse // the final chunk
	text                           string
	tokens                         int64 // the step's output tokens, as streamed
}

// modelStep runs one model step with in's sampling options and notes after the
// conversation, telling the model of in's tools (those of the tenant it names) unless it
// is the final step; it returns the step's result and those tools. On an error, the
// result, when not nil, holds the text streamed before it.
func (l *Loop) modelStep(ctx context.Context, id, model string, msgs []*modelproxyv1.Message, in *Input,
	notes []*modelproxyv1.Message, final bool) (*stepResult, *toollist.Tools, error) {
	if err := deadline.Check(ctx, l.cfg.MinModelTime, "model call "+id); err != nil {
		return nil, nil, err
	}
	tools := l.Tools(ctx).Only(in.Tools)
	req := &modelproxyv1.GenerateRequest{Model: model, Messages: msgs, Notes: notes,
		MaxTokens: in.MaxTokens, Temperature: in.Temperature}
	if !final {
		req.Tools = tools.Specs()
	}
	if in.ResponseSchema != "" {
		req.ResponseSchema = &modelproxyv1.ResponseSchema{Name: "answer", SchemaJson: in.ResponseSchema}
	}
	res, err := l.generate(ctx, id, req)
	return res, tools, err
}

// generate streams one model step of req as node id.
func (l *Loop) generate(ctx context.Context, id string, req *modelproxyv1.GenerateRequest) (*stepResult, error) {
	model := req.GetModel()
	cctx, stop := context.WithCancel(md.WithNode(ctx, id))
	defer stop()
	node := &meshv1.Node{Id: id, Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: model,
		Status: meshv1.NodeStatus_NODE_STATUS_RUNNING, StartedAt: timestamppb.Now()}
	// The decoder's lease, renewed from when the stream opens until it ends, and released
	// on every way out of the stream before anything else: a cancelled step's settle wait
	// must not keep renewing a decoder whose cancel may have been lost. It is keyed by
	// task and retry-id, so the retry-id is minted here rather than by the retry layer
	// (which keeps one it finds on the call). nil without a keeper.
	var lease *decoderlease.Lease
	if l.cfg.Leases != nil {
		var rid string
		var err error
		if cctx, rid, err = retry.WithID(cctx); err != nil {
			return nil, err
		}
		// chaos slow-heartbeat (a drill's fault; empty unless the service runs with
		// --chaos): renew only every so often, past the remaining/3 rule.
		lease = l.cfg.Leases.HoldEvery(cctx, decoderlease.Key{RunID: md.IdentityFrom(ctx).RunID, NodeID: id, RetryID: rid},
			chaos.From(ctx).SlowHeartbeat)
		req.LeaseTtl = l.cfg.Leases.TTLProto()
	}
	var (
		text  strings.Builder
		final *modelproxyv1.GenerateResponse
		last  time.Time
	)
	// A step whose decoder dies, or drains past its grace, mid-stream is started over on
	// another replica (retry.Restartable, under the retry policy): the step's text is the
	// new attempt's, streamed again from offset 0 as a step redone after a takeover is;
	// its tokens count every attempt's, as all were spent, and its Attempt says which
	// attempt streams now (0 until a restart).
	restarted := retry.Restartable(func(attempt int, _ error) {
		text.Reset()
		final = nil
		node.Attempt = int32(attempt + 1) //nolint:gosec // attempts are bounded by the retry policy, far below 2^31
	})
	st, err := l.cfg.Model.Generate(cctx, req, restarted)
	if err != nil {
		lease.Release()
		return nil, l.failed(ctx, l.cfg.ModelNodes, id, err)
	}
	l.cfg.Emit(cloneNode(node)) // a snapshot: node changes as tokens arrive
	for {
		resp, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			lease.Release()
			l.endModel(node, err)
			return &stepResult{text: text.String(), tokens: node.Tokens}, l.failed(ctx, l.cfg.ModelNodes, id, err)
		}
		if d := resp.GetDelta(); d != "" {
			l.cfg.EmitEvent(textDelta(id, d, text.Len()))
			text.WriteString(d)
		}
		node.Tokens += int64(resp.GetTokens())
		if resp.GetFinishReason() != "" {
			final = resp
		}
		if now := time.Now(); now.Sub(last) >= emitEvery {
			last = now
			l.cfg.Emit(cloneNode(node))
		}
	}
	lease.Release()
	if final == nil {
		err := status.Error(codes.Internal, "model stream ended without a finish reason")
		l.endModel(node, err)
		return nil, err
	}
	l.endModel(node, nil)
	return &stepResult{GenerateResponse: final, text: text.String(), tokens: node.Tokens}, nil
}

func (l *Loop) endModel(n *meshv1.Node, err error) {
	n.EndedAt = timestamppb.Now()
	n.Status = meshv1.NodeStatus_NODE_STATUS_SUCCEEDED
	if err != nil {
		o := nodes.ErrOutcome(err)
		n.Status, n.ErrorCode, n.ErrorMessage = o.Status, o.Code, o.Message
	}
	l.cfg.Emit(cloneNode(n))
}

// toolPolicy is what a loop's input says of its tool calls.
type toolPolicy struct {
	toModel bool     // a tool's failure is its result (see toolError)
	allowed []string // the tools it may call; any when empty
	failRun bool     // the run's own policy (Input.FailOnToolError), told to its tools
	// approval holds the ids of the calls that wait for a human's approval whatever the
	// registry says (a sim plan's "approval": true); toolrunner gates them.
	approval map[string]bool
}

// toolStep runs the calls in parallel under ctx, which ends at the loop's reserve (see
// RunResult; loop is the loop's own context). With p.toModel, a call's failure is its
// result (see toolError) unless the loop itself is ending; otherwise the first failure
// cancels the others with cause sibling_failed. When the reserve stops the step while
// the loop goes on, the calls it stopped get reserveResult as their results. It returns
// only after every call, and its remote teardown, has ended.
func (l *Loop) toolStep(loop, ctx context.Context, prefix string, calls []*modelproxyv1.ToolCall, tools *toollist.Tools, p toolPolicy) ([]string, error) {
	if len(calls) > l.cfg.MaxFanout {
		return nil, status.Errorf(codes.InvalidArgument, "step calls %d tools, more than the fan-out limit %d", len(calls), l.cfg.MaxFanout)
	}
	if len(calls) == 1 {
		// No sibling to cancel: run the call on this goroutine, under ctx itself (a group
		// context and a goroutine would be held for the whole call for nothing).
		out, err := l.callTool(ctx, prefix+".t0", calls[0], tools, p)
		if err == nil && ctx.Err() != nil {
			return []string{out}, nil
		}
		if ctx.Err() != nil || cutAtReserve(loop, ctx, err) {
			return reserveCut(loop, ctx, calls, make([]bool, 1), []string{""})
		}
		if err != nil && p.toModel && toolError(ctx, err) {
			return []string{errorResult(err)}, nil
		}
		if err != nil {
			return nil, err
		}
		return []string{out}, nil
	}
	gctx, cancelGroup := context.WithCancelCause(ctx)
	defer cancelGroup(nil)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
		outs     = make([]string, len(calls))
		done     = make([]bool, len(calls)) // the call has its result in outs
		ids      = make([]string, len(calls))
	)
	for j, c := range calls {
		ids[j] = fmt.Sprintf("%s.t%d", prefix, j)
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := l.callTool(gctx, ids[j], c, tools, p)
			if err == nil {
				outs[j], done[j] = out, true
				return
			}
			if p.toModel && toolError(ctx, err) {
				outs[j], done[j] = errorResult(err), true
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if firstErr != nil {
				return
			}
			firstErr = err
			if ctx.Err() == nil { // the parent is alive: this failure is the siblings' cause
				why, cause := cancel.ErrSiblingFailed, meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED
				switch {
				case budget.Refused(err):
					// The tenant's budget stopped a call below: the run is being stopped
					// for it, and the siblings with it.
					why, cause = cancel.ErrBudget, meshv1.CancelCause_CANCEL_CAUSE_BUDGET
				case atDeadline(ctx, err):
					// The child's own copy of the run's deadline fired a moment before ours:
					// that is the deadline stopping the step, not a failed sibling.
					why, cause = cancel.ErrDeadline, meshv1.CancelCause_CANCEL_CAUSE_DEADLINE
				case status.Code(err) == codes.Canceled:
					// The child was cancelled from elsewhere (the run's cancel broadcast can
					// reach it before it reaches this loop): not a failure here, so no
					// sibling_failed; the siblings inherit whatever cause stops this loop.
					why, cause = context.Canceled, meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED
				}
				at := time.Now()
				if l.cfg.Notes != nil && cause != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
					run := md.IdentityFrom(ctx).RunID
					for k := range calls {
						if k != j {
							l.cfg.Notes.Note(run, ids[k], cause, at)
						}
					}
				}
				cancelGroup(why)
			}
		}()
	}
	wg.Wait() // every branch settles its own remote teardown before returning
	if ctx.Err() != nil || cutAtReserve(loop, ctx, firstErr) {
		return reserveCut(loop, ctx, calls, done, outs)
	}
	if firstErr != nil {
		return nil, firstErr
	}
	return outs, nil
}

// cutAtReserve reports whether err, a tool call's, is the reserve stopping the step (ctx,
// the loop's reserve, and not the loop itself): the callee's copy of the deadline can fire,
// and its reset arrive, a moment before ctx's own timer.
func cutAtReserve(loop, ctx context.Context, err error) bool {
	return ctx != loop && err != nil && atDeadline(ctx, err)
}

// reserveCut ends a tool step whose ctx ended: when the loop goes on (the loop's reserve
// stopped the step), the calls without a result get reserveResult; otherwise the step
// ends with the loop's cancellation or deadline.
func reserveCut(loop, ctx context.Context, calls []*modelproxyv1.ToolCall, done []bool, outs []string) ([]string, error) {
	if loop.Err() != nil || ctx == loop {
		return nil, cancel.Status(ctx)
	}
	// calls, done and outs are one per call, of the same length.
	for j, c := range calls {
		if !done[j] { //nolint:gosec // G602: done has one entry per call
			outs[j] = reserveResult(c.GetName(), true) //nolint:gosec // G602: outs has one entry per call
		}
	}
	return outs, nil
}

// callTool runs one tool call as node id. tools, what the model was told of, say the
// tool's side effects: a tool listed as none or idempotent is retried freely, an
// irreversible one, or one whose effects are not known, only with an idempotency key.
func (l *Loop) callTool(ctx context.Context, id string, c *modelproxyv1.ToolCall, tools *toollist.Tools, p toolPolicy) (string, error) {
	if err := deadline.Check(ctx, l.cfg.MinToolTime, "tool "+c.GetName()); err != nil {
		return "", err
	}
	if len(p.allowed) > 0 && !slices.Contains(p.allowed, c.GetName()) {
		return "", status.Errorf(codes.NotFound, "tool %s is not among the run's tools", c.GetName())
	}
	cctx := md.WithNode(ctx, id)
	var opts []grpc.CallOption
	if tools.NeedsKey(c.GetName()) {
		// Retried only with an idempotency key: a second run of it is a second effect.
		opts = append(opts, retry.SideEffect())
	}
	// kv_put and notify without a key of the caller's get one from toolrunner, derived
	// from the call's identity and arguments, the same on every attempt.
	if k := c.GetIdempotencyKey(); k != "" {
		cctx = metadata.AppendToOutgoingContext(cctx, md.IdempotencyKey, k)
	}
	// The run's tool-error policy travels with the call: spawn_subagent gives it to the
	// nested loop. It is the run's setting, not this step's (a sim step fails on any
	// error, whatever the run says).
	toolErrors := md.ToolErrorsToModel
	if p.failRun {
		toolErrors = md.ToolErrorsFailRun
	}
	cctx = metadata.AppendToOutgoingContext(cctx, md.ToolErrors, toolErrors)
	// The caller's view of the tool node, for progress: toolrunner streams only the nodes
	// beneath a tool (a subagent's). The call stays retryable after them (execute makes
	// it Restartable). The summary takes the node from toolrunner's own record.
	// Each event gets a node of its own, built when it is sent: nothing is held for the
	// node while the tool runs but its start instant.
	started := time.Now()
	toolNode := func() *meshv1.Node {
		return &meshv1.Node{Id: id, Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: c.GetName(),
			Status: meshv1.NodeStatus_NODE_STATUS_RUNNING, StartedAt: timestamppb.New(started)}
	}
	l.cfg.Emit(toolNode())
	end := func(err error) {
		node := toolNode()
		node.EndedAt = timestamppb.Now()
		o := nodes.ErrOutcome(err)
		node.Status, node.ErrorCode, node.ErrorMessage = o.Status, o.Code, o.Message
		l.cfg.Emit(node)
	}
	req := &toolrunnerv1.ExecuteRequest{Name: c.GetName(), ArgsJson: c.GetArgsJson(), RequireApproval: p.approval[c.GetId()]}
	var (
		out string
		err error
	)
	if l.cfg.Hedge != nil && !p.approval[c.GetId()] && tools.Hedgeable(c.GetName()) {
		out, err = l.hedgedTool(cctx, id, req, opts)
	} else {
		out, err = l.execute(cctx, id, req, opts, true)
	}
	if err != nil {
		l.toolGone(ctx, c.GetName(), err)
		err = l.failed(ctx, l.cfg.ToolNodes, id, err)
		end(err)
		return "", err
	}
	end(nil)
	return out, nil
}

// execute runs one Execute call of tool node id and returns its result. With emit, the
// nodes and node events it streams are passed on; a hedged call's backup passes none
// (its twin's are the node's).
func (l *Loop) execute(ctx context.Context, id string, req *toolrunnerv1.ExecuteRequest, opts []grpc.CallOption, emit bool) (string, error) {
	var out *toolrunnerv1.ExecuteResult
	// A call whose toolrunner (or, beneath spawn_subagent, subagent) dies or drains past
	// its grace after streaming nodes is started over on another replica, under the
	// retry policy: its side effects are guarded as on any retry (an idempotency key for
	// a side-effect tool), and the nodes beneath it are streamed again by the new attempt.
	opts = append(slices.Clip(opts), retry.Restartable(func(int, error) { out = nil }))
	st, err := l.cfg.Tools.Execute(ctx, req, opts...)
	if err != nil {
		return "", err
	}
	for {
		ev, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return "", err
		}
		switch e := ev.GetEvent().(type) {
		case *toolrunnerv1.ExecuteResponse_Node:
			if emit {
				l.cfg.Emit(e.Node)
			}
		case *toolrunnerv1.ExecuteResponse_NodeEvent:
			if emit && within(e.NodeEvent.GetNodeId(), id) {
				l.cfg.EmitEvent(e.NodeEvent)
			}
		case *toolrunnerv1.ExecuteResponse_Result:
			out = e.Result
		}
	}
	if out == nil {
		return "", status.Errorf(codes.Internal, "tool %s ended without a result", req.GetName())
	}
	return out.GetOutputJson(), nil
}

// hedgedTool runs tool node id's call under the hedging policy: both runs share one
// retry-id (the same logical call), and the backup runs as node id/HedgeNode, marked
// curfew-hedge by retry.Hedge, which also draws it from toolrunner's retry budget. The
// run that loses is cancelled with cause superseded, and noted so (Notes) for the
// run's summary.
func (l *Loop) hedgedTool(ctx context.Context, id string, req *toolrunnerv1.ExecuteRequest, opts []grpc.CallOption) (string, error) {
	rid, err := retry.NewID()
	if err != nil {
		return "", status.Errorf(codes.Internal, "tool %s: %v", req.GetName(), err)
	}
	ctx = metadata.AppendToOutgoingContext(ctx, md.RetryID, rid)
	backupNode := id + "/" + HedgeNode
	return l.cfg.Hedge.Do(ctx, req.GetName(), l.cfg.MinToolTime, func(cctx context.Context, backup bool) (string, error) {
		node, o := id, opts
		if backup {
			node, o = backupNode, append(slices.Clip(opts), retry.Hedge())
			cctx = md.WithNode(cctx, node)
		}
		out, err := l.execute(cctx, node, req, o, !backup)
		if err != nil && errors.Is(context.Cause(cctx), cancel.ErrSuperseded) && l.cfg.Notes != nil {
			l.cfg.Notes.Note(md.IdentityFrom(ctx).RunID, node, meshv1.CancelCause_CANCEL_CAUSE_SUPERSEDED, time.Now())
		}
		return out, err
	})
}

// toolGone drops the tenant's list when toolrunner did not know a tool that is not a
// built-in (NOT_FOUND): the list the model was told of may name a tool its source no
// longer has, or no longer lets the tenant call, so the next step lists again.
func (l *Loop) toolGone(ctx context.Context, name string, err error) {
	if status.Code(err) == codes.NotFound && l.cfg.ToolList != nil && !catalog.IsBuiltin(name) {
		l.cfg.ToolList.Invalidate(md.IdentityFrom(ctx).Tenant)
	}
}

// toolError reports whether err, a tool call's failure, is the tool's own (its arguments,
// its result, its executor, its own time limit) rather than the loop's ending: a
// cancellation, the loop's deadline or the tenant's budget is never handed to the model.
func toolError(ctx context.Context, err error) bool {
	if ctx.Err() != nil || budget.Refused(err) {
		return false
	}
	switch status.Code(err) {
	case codes.Canceled:
		return false
	case codes.DeadlineExceeded:
		return !atDeadline(ctx, err)
	}
	return true
}

// errorResult is a failed tool call's result as the model is told of it:
// {"error": "<the status message>"}.
func errorResult(err error) string {
	b, _ := json.Marshal(map[string]string{"error": status.Convert(err).Message()})
	return string(b)
}

// within reports whether node is root or lies beneath it.
func within(node, root string) bool {
	return node == root || strings.HasPrefix(node, root+"/")
}

// atDeadline reports whether err is a DEADLINE_EXCEEDED that ctx's own deadline explains.
func atDeadline(ctx context.Context, err error) bool {
	return status.Code(err) == codes.DeadlineExceeded && deadline.Remaining(ctx, time.Now()) <= cancel.DeadlineSlop
}

// failed handles a child call's error. When ctx was cancelled, the child is being torn
// down remotely: wait (on a budget of its own) for the executor to report its end, then
// return the cancellation. Otherwise return the child's own error.
func (l *Loop) failed(ctx context.Context, reports meshv1.NodeReportServiceClient, id string, err error) error {
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		// The deadline has passed but its timer may not have fired yet: the callee's
		// transport fires its own copy and resets the stream, which can reach us first.
		// That error is our deadline, so wait the instant for ctx to say so, and settle.
		<-ctx.Done()
	} else {
		cancel.Await(ctx, err)
	}
	if ctx.Err() == nil {
		return err
	}
	if reports != nil {
		_ = cancel.Settle(ctx, reports, id, l.cfg.SettleTimeout)
	}
	return cancel.Status(ctx)
}

// textDelta is the node event of model node id's text d, which follows offset bytes of
// the node's text.
func textDelta(id, d string, offset int) *meshv1.NodeEvent {
	return &meshv1.NodeEvent{NodeId: id, At: timestamppb.Now(),
		Kind: &meshv1.NodeEvent_Text{Text: &meshv1.TextDelta{Text: d, Offset: int64(offset)}}}
}

func cloneNode(n *meshv1.Node) *meshv1.Node { return proto.Clone(n).(*meshv1.Node) }
