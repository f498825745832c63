package orchestrator

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/md"
)

func newAdmittedEnv(t *testing.T, cfg admission.Config, fm *fakeModel) (*env, *admission.Controller) {
	t.Helper()
	adm, err := admission.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(adm.Close)
	e := newEnvWith(t, mesh.ServerConfig{}, fm, func(c *Config) { c.Admission = adm })
	return e, adm
}

// wantShed checks a RESOURCE_EXHAUSTED refusal with its reason and a retry delay.
func wantShed(t *testing.T, err error, reason admission.Reason) {
	t.Helper()
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted {
		t.Fatalf("err = %v, want RESOURCE_EXHAUSTED (%s)", err, reason)
	}
	var delay, info bool
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.RetryInfo:
			delay = d.GetRetryDelay() != nil
		case *errdetails.ErrorInfo:
			info = info || d.GetReason() == reason.ErrorInfoReason()
		}
	}
	if !delay || !info {
		t.Fatalf("shed %v: RetryInfo %v, ErrorInfo %s %v", err, delay, reason.ErrorInfoReason(), info)
	}
}

// The paid pool never runs more than its cap: a second critical run waits in the queue
// until the first ends, and no decoder of it starts meanwhile.
func TestAdmissionPaidPoolCap(t *testing.T) {
	cfg := DefaultAdmission()
	cfg.Pools[0].MaxInFlight = 1
	e, adm := newAdmittedEnv(t, cfg, nil)
	first, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: slowPlan, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	e.waitDecoder(t)
	second := make(chan error, 1)
	go func() {
		_, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: tinyPlan, Timeout: durationpb.New(20 * time.Second)})
		second <- err
	}()
	for deadline := time.Now().Add(3 * time.Second); ; {
		if st, _ := adm.Stats("paid"); st.Queued() == 1 && st.InFlight == 1 {
			break
		}
		if time.Now().After(deadline) {
			st, _ := adm.Stats("paid")
			t.Fatalf("paid pool %+v, want 1 running and 1 queued", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case n := <-e.model.started:
		t.Fatalf("decoder %s started while its run was queued", n)
	case <-time.After(200 * time.Millisecond):
	}
	if _, err := e.orch.CancelRun(context.Background(), &orchestratorv1.CancelRunRequest{RunId: first.GetRun().GetRunId()}); err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatalf("queued run: %v", err)
	}
}

// Sheddable work whose slack is below the expected service time plus the cancel grace is
// shed before any model call; critical work with the same deadline runs.
func TestAdmissionSlackShedBeforeAnyModelCall(t *testing.T) {
	e, _ := newAdmittedEnv(t, DefaultAdmission(), nil)
	ctx := metadata.AppendToOutgoingContext(context.Background(), md.Criticality, "sheddable")
	_, err := e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: tinyPlan, Timeout: durationpb.New(800 * time.Millisecond)})
	wantShed(t, err, admission.ReasonDeadlineSlack)
	rs, _ := e.start(context.Background(), t, &orchestratorv1.RunRequest{Task: tinyPlan})
	if _, err := rs.rest(); err != nil {
		t.Fatal(err)
	}
	if got := e.decoders(); len(got) != 1 {
		t.Errorf("decoders %v: want only the critical run's", got)
	}
	_, err = e.orch.StartRun(metadata.AppendToOutgoingContext(context.Background(), md.Criticality, "urgent"),
		&orchestratorv1.StartRunRequest{Task: tinyPlan})
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("unknown criticality: %v, want INVALID_ARGUMENT", err)
	}
}

// A tenant over its token budget is refused before any work starts; a run that ends early
// gives back the unused part of its reservation.
func TestAdmissionTenantBudget(t *testing.T) {
	cfg := DefaultAdmission()
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {TokenBudget: 1010, Window: time.Hour}}
	e, adm := newAdmittedEnv(t, cfg, nil)
	ctx := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, "acme")
	// slowPlan expects 1001 tokens: reserved, then cancelled after a few.
	res, err := e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: slowPlan, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	e.waitDecoder(t)
	if u := adm.TenantUsage("acme"); u.Reserved != 1001 {
		t.Errorf("reserved %d, want the plan's 1001", u.Reserved)
	}
	_, err = e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: fastPlan})
	wantShed(t, err, admission.ReasonBudget)
	time.Sleep(150 * time.Millisecond)
	cr, err := e.orch.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: res.GetRun().GetRunId()})
	if err != nil {
		t.Fatal(err)
	}
	u := adm.TenantUsage("acme")
	spent := cr.GetRun().GetTokens() + cr.GetRun().GetPromptTokens()
	if u.Reserved != 0 || u.Used != spent || u.Used >= 1001 {
		t.Fatalf("after the early end: %+v, want nothing reserved and the %d tokens spent used", u, spent)
	}
	if _, err := e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: tinyPlan}); err != nil {
		t.Fatalf("within budget again: %v", err)
	}
}

// A run that spent tokens after its cancel (orphan tokens) closes the overflow pool:
// sheddable work is shed with pool_closed, critical work still runs.
func TestAdmissionOverflowFailsClosedOnOrphanTokens(t *testing.T) {
	e, adm := newAdmittedEnv(t, DefaultAdmission(), &fakeModel{orphan: 3})
	res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: slowPlan, Timeout: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	e.waitDecoder(t)
	cr, err := e.orch.CancelRun(context.Background(), &orchestratorv1.CancelRunRequest{RunId: res.GetRun().GetRunId()})
	if err != nil || cr.GetRun().GetTokensAfterCancel() == 0 {
		t.Fatalf("cancel: %v, %d orphan tokens (the fake decoder spends 3)", err, cr.GetRun().GetTokensAfterCancel())
	}
	if closed, why := adm.Closed("overflow"); !closed {
		t.Fatalf("overflow still open (%s) after a run leaked tokens", why)
	}
	ctx := metadata.AppendToOutgoingContext(context.Background(), md.Criticality, "sheddable")
	_, err = e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: tinyPlan, Timeout: durationpb.New(10 * time.Second)})
	wantShed(t, err, admission.ReasonPoolClosed)
	if _, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: tinyPlan}); err != nil {
		t.Fatalf("critical run: %v", err)
	}
}

// One token per decoder after the cancel instant is propagation, not an orphan: only the
// excess feeds the overflow pool's fail-closed condition.
func TestOrphanTokensBeyondTheInFlightAllowance(t *testing.T) {
	model := func(after int64) *meshv1.Node {
		return &meshv1.Node{Kind: meshv1.NodeKind_NODE_KIND_MODEL, TokensAfterCancel: after}
	}
	for _, c := range []struct {
		nodes []*meshv1.Node
		want  int64
	}{
		{nil, 0},
		{[]*meshv1.Node{model(1), model(1), model(0)}, 0},
		{[]*meshv1.Node{model(3), model(1)}, 2},
		{[]*meshv1.Node{model(40), {Kind: meshv1.NodeKind_NODE_KIND_TOOL, TokensAfterCancel: 9}}, 39},
	} {
		if got := orphanTokens(&orchestratorv1.Run{Nodes: c.nodes}); got != c.want {
			t.Errorf("orphanTokens(%v) = %d, want %d", c.nodes, got, c.want)
		}
	}
}

// A tenant's max_deadline refuses a run that asks for more time (OUT_OF_RANGE, the limit
// in a BadRequest detail) before anything starts, for StartRun and Run alike; a run
// within it, and another tenant's longer run, start.
func TestAdmissionTenantMaxDeadline(t *testing.T) {
	cfg := DefaultAdmission()
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {MaxDeadline: 5 * time.Second}}
	e, _ := newAdmittedEnv(t, cfg, nil)
	acme := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, "acme")
	_, err := e.orch.StartRun(acme, &orchestratorv1.StartRunRequest{Task: tinyPlan, Timeout: durationpb.New(time.Minute)})
	st := status.Convert(err)
	if st.Code() != codes.OutOfRange || !strings.Contains(st.Message(), "max_deadline 5s") {
		t.Fatalf("StartRun for 1m: %v, want OUT_OF_RANGE naming max_deadline 5s", err)
	}
	var field bool
	for _, d := range st.Details() {
		if br, ok := d.(*errdetails.BadRequest); ok && len(br.GetFieldViolations()) == 1 && br.GetFieldViolations()[0].GetField() == "deadline" {
			field = true
		}
	}
	if !field {
		t.Errorf("no BadRequest detail on field deadline: %v", st.Details())
	}
	ctx, cancel := context.WithTimeout(acme, time.Minute)
	defer cancel()
	st2, err := e.orch.Run(ctx, &orchestratorv1.RunRequest{Task: tinyPlan})
	if err == nil {
		_, err = st2.Recv()
	}
	if status.Code(err) != codes.OutOfRange {
		t.Errorf("Run with a 1m deadline: %v, want OUT_OF_RANGE", err)
	}
	if got := e.decoders(); len(got) != 0 {
		t.Fatalf("decoders %v started for refused runs", got)
	}
	if _, err := e.orch.StartRun(acme, &orchestratorv1.StartRunRequest{Task: tinyPlan, Timeout: durationpb.New(5 * time.Second)}); err != nil {
		t.Errorf("StartRun for exactly the maximum: %v", err)
	}
	if _, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: tinyPlan, Timeout: durationpb.New(time.Minute)}); err != nil {
		t.Errorf("another tenant's 1m run: %v", err)
	}
}

// A run's budget charge is its output tokens and its prompt tokens.
func TestAdmissionBudgetChargesPromptTokens(t *testing.T) {
	cfg := DefaultAdmission()
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {TokenBudget: 100000, Window: time.Hour}}
	e, adm := newAdmittedEnv(t, cfg, nil)
	ctx := metadata.AppendToOutgoingContext(context.Background(), md.Tenant, "acme")
	rs, _ := e.start(ctx, t, &orchestratorv1.RunRequest{Task: fastPlan})
	evs, err := rs.rest()
	if err != nil || len(evs) == 0 {
		t.Fatal(err)
	}
	r := evs[len(evs)-1].GetFinished()
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run %v", r.GetStatus())
	}
	var models int64
	for _, n := range r.GetNodes() {
		if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL {
			models++
		}
	}
	if r.GetTokens() == 0 || r.GetPromptTokens() < fakePromptTokens*models {
		t.Fatalf("run tokens %d prompt %d over %d model nodes: want both counted", r.GetTokens(), r.GetPromptTokens(), models)
	}
	if u := adm.TenantUsage("acme"); u.Used != r.GetTokens()+r.GetPromptTokens() || u.Reserved != 0 {
		t.Fatalf("tenant usage %+v, want %d output + %d prompt tokens used", u, r.GetTokens(), r.GetPromptTokens())
	}
}
