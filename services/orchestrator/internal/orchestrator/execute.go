package orchestrator

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/toollist"
	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// execute runs the loop, then ends the root node, waits for the tree's teardown,
// assembles the summary, commits it to the store and publishes it.
func (s *Server) execute(rctx context.Context, rn *run, in agent.Input, j agent.Journal) {
	lc := s.cfg.Loop
	lc.Notes = s.nodes
	lc.Emit, lc.EmitEvent = rn.publishNode, rn.publishEvent
	answer, err := s.runLoop(rctx, rn, agent.New(lc), in, j)
	if rn.moved() {
		s.abandon(rctx, rn)
		return
	}
	if budget.Refused(err) && rctx.Err() == nil {
		// A model call of the tree that the tenant's budget could not cover (modelproxy
		// refused it before it started): the run stops for its budget. The decoders-first
		// cancel ends every node still running with cause budget, and modelproxy starts
		// no model call of the run after it.
		rn.cancelWith(fmt.Errorf("%w: %s", cancel.ErrBudget, status.Convert(err).Message()))
	}
	o := nodes.OutcomeOf(rctx, err)
	if o.Status == meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED {
		o.Cause = meshv1.CancelCause_CANCEL_CAUSE_DEADLINE
	}
	rn.mu.Lock()
	cancelAt, reaches := rn.cancelAt, rn.reaches
	rn.mu.Unlock()
	if cancelAt.IsZero() && o.Cause == meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
		// Stopped by the deadline. The child's DEADLINE_EXCEEDED (its own copy of the
		// deadline, or a fast-fail) can arrive before rctx's timer has fired, so do not
		// require rctx.Err(); the instant is the deadline, or now if that is earlier.
		cancelAt = rn.dl
		if now := time.Now(); now.Before(cancelAt) {
			cancelAt = now
		}
	}
	root := s.nodes.End(rn.id, RootNode, o.Status, o.Cause, o.Code, o.Message, func(n *meshv1.Node) {
		if !cancelAt.IsZero() {
			n.CancelledAt = timestamppb.New(cancelAt)
		}
	})
	rn.cancel(nil) // release the run context; children have ended
	lc.Emit(root)

	cctx, stop := context.WithTimeout(context.WithoutCancel(rctx), s.cfg.SettleTimeout+2*time.Second)
	ns := s.collect(cctx, rn.id, reaches, cancelAt, s.cfg.SettleTimeout)
	stop()

	rn.mu.Lock()
	r := rn.rec
	r.EndedAt = timestamppb.Now()
	r.Status = runStatus(o.Status)
	r.Cause = o.Cause
	r.ErrorCode, r.ErrorMessage = o.Code, o.Message
	if err == nil {
		r.Answer = answer
	}
	if !cancelAt.IsZero() {
		r.CancelledAt = timestamppb.New(cancelAt)
	}
	setNodes(r, ns)
	tokens, after := r.Tokens, r.TokensAfterCancel
	rn.finishing = true
	rn.mu.Unlock()
	tracing.EndRun(rn.span, o.Status, o.Cause, o.Code, o.Message, tokens, after)
	s.endAdmission(rn, rn.snapshot(s.shared)) //nolint:contextcheck // a ticket's release has no caller context
	if !s.commit(rctx, rn) {
		s.abandon(rctx, rn)
		return
	}
	close(rn.done)
	s.logFinished(rctx, rn.snapshot(s.shared))
}

// Parking on an open breaker. A run with a journal whose step was refused by an open
// breaker (its dependency is fenced off: say a toolrunner restarting) does not fail
// while it has time: it waits the breaker's RetryInfo, then the loop starts again from
// the run's journal, so nothing completed is repeated. Only a refusal qualifies: the
// refused call was never sent, and a step is resumed only if every tool of it is safe to
// run again (no side-effect tool without an idempotency key: a sibling cancelled
// mid-call may have had its effect). Any other failure, retried to exhaustion by the
// call's own retry layer, fails the run: one retrying layer, no amplification.
//
// breakerParking is its policy: MaxAttempts loops in all (more than a call may make:
// a park sends nothing), each park the longer of the policy's backoff and the breaker's
// RetryInfo, plus up to a fifth more.
var breakerParking = retry.Policy{MaxAttempts: 9, Base: 500 * time.Millisecond, Cap: 5 * time.Second}

// runLoop runs the agent loop and, with a journal, runs it again after a breaker
// refusal (see breakerParking), while the run has time left for the wait.
func (s *Server) runLoop(rctx context.Context, rn *run, loop *agent.Loop, in agent.Input, j agent.Journal) (string, error) {
	for attempt := 1; ; attempt++ {
		answer, err := loop.RunInput(rctx, RootNode, in, j)
		if err == nil || j == nil || rn.moved() || rctx.Err() != nil || attempt >= breakerParking.MaxAttempts {
			return answer, err
		}
		oe, refused := breaker.Open(err)
		if !refused || !safeToResume(j.Replay(), loop.Tools(rctx)) {
			return answer, err
		}
		d := max(breakerParking.Backoff(attempt+1, rand.Float64), oe.RetryAfter)
		d += time.Duration(rand.Int64N(int64(d)/5 + 1)) //nolint:gosec // jitter that spreads the runs one breaker refused together
		if time.Until(rn.dl) < d+s.cfg.MinRunTime {
			return answer, err
		}
		s.cfg.Log.WarnContext(rctx, "a step was refused by an open breaker; the run resumes from its journal after the breaker's delay",
			"run_id", rn.id, "attempt", attempt, "target", oe.Target, "backoff_ms", d.Milliseconds())
		t := time.NewTimer(d)
		select {
		case <-rctx.Done():
			t.Stop()
			return answer, err
		case <-t.C:
		}
	}
}

// safeToResume reports whether the step the journal stopped in may run again: its
// tool calls (if its model output was recorded) have no side effect without a key, as
// tools (toolrunner's list of the tenant's tools) says: a tool listed as none or
// idempotent may run again; an irreversible one, or one whose effects are not known
// (not listed, or toolrunner did not answer), only with a key.
func safeToResume(entries []agent.Entry, tools *toollist.Tools) bool {
	if len(entries) == 0 {
		return true
	}
	last := entries[len(entries)-1]
	if last.Kind != agent.EntryModel {
		return true // the failure was in a model step: nothing of it was done
	}
	for _, c := range last.ToolCalls {
		if tools.NeedsKey(c.GetName()) && c.GetIdempotencyKey() == "" {
			return false
		}
	}
	return true
}

// The executors of Config.Reports, by index.
const (
	reportModel    = iota // modelproxy
	reportTool            // toolrunner
	reportSubagent        // subagent
)

// reportSet is a set of Config.Reports indexes: the executors whose node reports may
// hold nodes of a run.
type reportSet uint8

// allReports is every executor.
const allReports = reportSet(1<<reportModel | 1<<reportTool | 1<<reportSubagent)

// reachedBy is where node n, published by a run's loop, says the run's nodes go: a
// tool call to toolrunner; a subagent (spawn_subagent, or a node of one) to all three, as
// a subagent calls models and tools itself. The loop publishes a tool's node before it
// calls the tool, so a run's set holds toolrunner before toolrunner can hold a node of
// it. Model steps go to modelproxy, which a new run's set holds from its start.
func reachedBy(n *meshv1.Node) reportSet {
	switch {
	case n.GetKind() == meshv1.NodeKind_NODE_KIND_SUBAGENT,
		n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL && n.GetName() == plan.ToolSpawnSubagent:
		return allReports
	case n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL:
		return 1 << reportTool
	}
	return 0
}

// collect merges this process's nodes of the run with the reports of the executors in
// reaches. With settle > 0 each executor first waits for the run's nodes to end.
func (s *Server) collect(ctx context.Context, run string, reaches reportSet, cancelAt time.Time, settle time.Duration) []*meshv1.Node {
	local, _ := s.nodes.List(ctx, run, nil, 0)
	reports := make([][]*meshv1.Node, len(s.cfg.Reports)+1)
	reports[0] = local
	req := &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(settle)}
	if !cancelAt.IsZero() {
		req.CancelAt = timestamppb.New(cancelAt)
	}
	var wg sync.WaitGroup
	for i, c := range s.cfg.Reports {
		if reaches&(1<<i) == 0 {
			continue // no node of the run there: nothing to wait for or read
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := c.ListNodes(ctx, req)
			if err != nil {
				s.cfg.Log.WarnContext(ctx, "node report unavailable; summary is incomplete", "run_id", run, "error", err.Error())
				return
			}
			switch {
			case resp.GetSettled():
			case settle > 0: // the executor waited and its nodes still run: worth a look
				s.cfg.Log.WarnContext(ctx, "nodes still running after the settle timeout", "run_id", run, "settle", settle)
			default: // nothing was waited for: nodes still ending is the normal case
				s.cfg.Log.DebugContext(ctx, "nodes still running; the summary was not waited for", "run_id", run)
			}
			reports[i+1] = resp.GetNodes()
		}()
	}
	wg.Wait()
	streamed := map[string]int64{}
	if rn, err := s.get(run); err == nil { // last: the executors' records come first
		rn.mu.Lock()
		reports = append(reports, slices.Clone(rn.failedCalls))
		for id, t := range rn.streamed {
			if t.retried { // a single attempt's record is its executor's alone
				streamed[id] = t.total()
			}
		}
		rn.mu.Unlock()
	}
	merged := nodes.Merge(reports...)
	for _, n := range merged {
		if t := streamed[n.GetId()]; n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL && t > n.GetTokens() {
			n.Tokens = t // the executor's record lost an earlier attempt (see run.streamed)
		}
	}
	return merged
}

func setNodes(r *orchestratorv1.Run, ns []*meshv1.Node) {
	r.Nodes = ns
	r.Tokens, r.TokensAfterCancel, r.PromptTokens = 0, 0, 0
	for _, n := range ns {
		r.Tokens += n.GetTokens()
		r.TokensAfterCancel += n.GetTokensAfterCancel()
		r.PromptTokens += n.GetPromptTokens()
	}
}

// runErr is the status a Run call ends with for its run's end.
func runErr(r *orchestratorv1.Run) error {
	if r.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		return nil
	}
	var c codes.Code
	if err := c.UnmarshalJSON([]byte(`"` + r.GetErrorCode() + `"`)); err != nil || c == codes.OK {
		c = codes.Unknown
	}
	return status.Error(c, r.GetErrorMessage())
}
