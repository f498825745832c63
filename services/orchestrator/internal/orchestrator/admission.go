package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// Admission (mesh/admission, docs/admission.md). Every new run, streamed or detached, is
// admitted before anything of it starts: its pool comes from the caller's criticality
// (curfew-criticality: critical, the default, or sheddable), its expected tokens are
// reserved against the tenant's budget, and the deadline-slack rule, queue limits and
// the overflow pool's fail-closed state may shed it with RESOURCE_EXHAUSTED and a retry
// delay. When it ends, its ticket is settled with the tokens it spent, and what its end
// says about the cancel path (orphan tokens, how long the cancel took to reach every
// leaf) feeds the fail-closed conditions. Runs taken over from a dead orchestrator were
// admitted where they started and are not admitted again.

// DefaultAdmission is the orchestrator's admission without --admission-config: a paid
// pool for critical work and an overflow pool for sheddable work, wide enough not to
// limit a single replica's ordinary load, with the library's queue limits, cancel grace
// and fail-closed window; each tenant may start DefaultTenantRate runs per second
// (burst twice that) and make DefaultTenantRequestRate calls per second to the public
// API (burst twice that); no concurrency limits or budgets.
func DefaultAdmission() admission.Config {
	return admission.Config{
		Pools: []admission.PoolConfig{
			{Name: "paid", MaxInFlight: 512},
			{Name: "overflow", MaxInFlight: 128, Overflow: true},
		},
		DefaultTenant: admission.TenantLimits{Rate: DefaultTenantRate, Burst: 2 * DefaultTenantRate,
			RequestRate: DefaultTenantRequestRate, RequestBurst: 2 * DefaultTenantRequestRate},
	}.WithDefaults()
}

// DefaultTenantRate is the runs per second a tenant may start under DefaultAdmission.
const DefaultTenantRate = 50

// DefaultTenantRequestRate is the calls per second a tenant may make to the public API
// under DefaultAdmission: far above what a client polling its runs needs, low enough
// that one tenant cannot keep a replica busy with reads.
const DefaultTenantRequestRate = 1000

// admit admits a new run of the caller. A nil ticket (no admission configured) is valid:
// Release on it does nothing.
func (s *Server) admit(ctx context.Context, model, task string) (*admission.Ticket, error) {
	if s.cfg.Admission == nil {
		return nil, nil
	}
	id := md.IdentityFrom(ctx)
	if id.Attempt > 1 && id.RetryID == "" {
		// A retry that cannot be told from a new call: duplicates cannot be detected
		// downstream, so the overflow pool must not take work until this stops.
		s.cfg.Admission.ObserveRetryWithoutID()
	}
	crit := admission.Critical
	if v := metadata.ValueFromIncomingContext(ctx, md.Criticality); len(v) > 0 && v[0] != "" {
		c, err := admission.ParseCriticality(v[0])
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "%s: %v", md.Criticality, err)
		}
		crit = c
	}
	if hb := chaos.From(ctx).SlowHeartbeat; hb > 0 {
		// chaos slow-heartbeat (a drill's fault 2): this run's decoder leases would be
		// renewed only every hb. Seed 003: "heartbeat period is larger than one third of
		// the deadline" fails the overflow pool closed.
		if dl, ok := ctx.Deadline(); ok {
			s.cfg.Admission.ObserveHeartbeat(hb, time.Until(dl))
		}
	}
	tk, err := s.cfg.Admission.Admit(ctx, admission.Request{Tenant: id.Tenant, Criticality: crit, Class: model,
		ExpectedTokens: expectedTokens(model, task)})
	if err != nil {
		if se, ok := admission.AsShed(err); ok {
			s.sheds.add(id.Tenant)
			s.cfg.Log.InfoContext(ctx, "run shed at admission", "reason", string(se.Reason), "pool", se.Pool,
				"retry_after_ms", se.RetryAfter.Milliseconds(), "detail", se.Detail)
			return nil, err // a ShedError is its own gRPC status
		}
		if ctx.Err() != nil {
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		var st interface{ GRPCStatus() *status.Status }
		if errors.As(err, &st) {
			return nil, err
		}
		return nil, status.Errorf(codes.InvalidArgument, "admission: %v", err)
	}
	return tk, nil
}

// expectedTokens is what a run is expected to spend, reserved against its tenant's
// budget: a sim plan's tokens, else unknown (0; the budget then counts one token).
func expectedTokens(model, task string) int64 {
	if model != agent.DefaultModel {
		return 0
	}
	p, err := plan.Parse([]byte(task))
	if err != nil {
		return 0
	}
	return planTokens(p, 0)
}

// planTokens sums a plan's steps and the plans of its subagents, to a bounded depth.
func planTokens(p *plan.Plan, depth int) int64 {
	var n int64
	for _, st := range p.Steps {
		n += int64(st.ThinkTokens + st.AnswerTokens)
		if depth >= 4 {
			continue
		}
		for _, tl := range st.Tools {
			if tl.Name != plan.ToolSpawnSubagent {
				continue
			}
			var a plan.SpawnArgs
			if plan.Args(tl.Args, &a) != nil {
				continue
			}
			if !plan.LooksLikePlan(a.SpawnTask()) {
				continue
			}
			if sub, err := plan.Parse([]byte(a.SpawnTask())); err == nil {
				n += planTokens(sub, depth+1)
			}
		}
	}
	return n
}

// orphanTokens are the run's tokens after its cancel beyond the in-flight allowance of
// each decoder (nodes.OrphanTokens): one token per decoder is propagation, and must not
// close the overflow pool for a minute after every ordinary cancel.
func orphanTokens(r *orchestratorv1.Run) int64 {
	var n int64
	for _, nd := range r.GetNodes() {
		n += nodes.OrphanTokens(nd)
	}
	return n
}

// endAdmission releases the run's admission ticket with what the run spent, and tells
// admission what the run's end says about the cancel path.
func (s *Server) endAdmission(rn *run, r *orchestratorv1.Run) {
	if s.cfg.Admission == nil {
		return
	}
	end := admission.EndFailed
	switch r.GetStatus() {
	case orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED:
		end = admission.EndCompleted
	case orchestratorv1.RunStatus_RUN_STATUS_CANCELLED:
		end = admission.EndCancelled
	case orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED:
		end = admission.EndDeadline
	}
	// The budget counts what a run was charged: its output tokens and its prompt tokens.
	rn.ticket.Release(admission.Outcome{Tokens: r.GetTokens() + r.GetPromptTokens(), Service: r.GetEndedAt().AsTime().Sub(r.GetCreatedAt().AsTime()), Ended: end})
	s.cfg.Admission.ObserveOrphanTokens(orphanTokens(r))
	if r.GetCancelledAt() == nil {
		return
	}
	at := r.GetCancelledAt().AsTime()
	var last time.Time // when the last node still running at the cancel stopped
	for _, n := range r.GetNodes() {
		if n.GetEndedAt() == nil || n.GetStartedAt().AsTime().After(at) {
			continue
		}
		if e := n.GetEndedAt().AsTime(); e.After(last) {
			last = e
		}
	}
	if last.After(at) {
		s.cfg.Admission.ObserveCancelPropagation(last.Sub(at), rn.dl.Sub(at))
	}
}

// tenantDeadlineSlack absorbs the time a run's request spent reaching create: a deadline the
// caller set to exactly its tenant's maximum is not refused for the milliseconds lost on
// the way.
const tenantDeadlineSlack = time.Second

// checkTenantDeadline refuses a run whose deadline is further away than its tenant's
// max_deadline (admission config), OUT_OF_RANGE with the limit in a BadRequest detail,
// before anything is recorded or started.
func (s *Server) checkTenantDeadline(tenant string, dl time.Time) error {
	if s.cfg.Admission == nil {
		return nil
	}
	limit := s.cfg.Admission.TenantLimits(tenant).MaxDeadline
	left := time.Until(dl)
	if limit <= 0 || left <= limit+tenantDeadlineSlack {
		return nil
	}
	st := status.Newf(codes.OutOfRange, "deadline %v away exceeds tenant %q's max_deadline %v: ask for %v or less",
		left.Round(time.Millisecond), tenant, limit, limit)
	if d, err := st.WithDetails(&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{{
		Field: "deadline", Description: fmt.Sprintf("at most %v for tenant %q (admission max_deadline)", limit, tenant)}}}); err == nil {
		st = d
	}
	return st.Err()
}
