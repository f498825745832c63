package orchestrator

import (
	"context"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// startRequest is a new run as its caller asked for it.
type startRequest struct {
	tenant, key, model, task string
	// input is the rest of the run's input; nil when there is none.
	input *orchestratorv1.RunInput
	// timeout is the run's time from now, capped at MaxRunTime; 0: the call's own
	// deadline.
	timeout time.Duration
	// attached: a Run call follows the run. It gets a subscription of detail events
	// made before the run starts, so that no event is missed, and the call's chaos
	// settings go to the run's children (withRunChaos).
	attached bool
	events   detail
}

// started is what start started: a new run (with, when attached, its root node as it
// started and the subscription), or the existing run that the request's key names.
type started struct {
	rn       *run
	root     *meshv1.Node
	sub      chan *orchestratorv1.RunResponse
	existing *orchestratorv1.Run
}

// start is the one way a new run starts, for Run, StartRun and Replay alike: validate →
// draining → minimum time → admit → create (releasing the admission if that fails) →
// launch. A run taken over from another orchestrator enters at launch (resume).
func (s *Server) start(ctx context.Context, req startRequest) (started, error) {
	model, err := s.validate(req.task, req.model, req.input)
	if err != nil {
		return started{}, err
	}
	if s.draining.Load() {
		// No new run; a key that already names one of this process's runs still gets it.
		if r, err := s.existingRun(req.tenant, req.key, model, req.task, req.input); r != nil || err != nil {
			return started{existing: r}, err
		}
		return started{}, errDraining()
	}
	dl, err := s.runDeadline(ctx, req.timeout)
	if err != nil {
		return started{}, err
	}
	// Admission waits on the run's own deadline, not the call's, and stops waiting when
	// the caller leaves.
	actx, stop := context.WithDeadline(context.WithoutCancel(ctx), dl)
	defer stop()
	defer context.AfterFunc(ctx, stop)()
	tk, err := s.admit(actx, model, req.task)
	if err != nil {
		return started{}, err
	}
	rn, existing, err := s.create(ctx, req.tenant, req.key, model, req.task, req.input, dl)
	if err != nil || rn == nil {
		tk.Release(admission.Outcome{Ended: admission.EndFailed}) //nolint:contextcheck // a ticket's release (its cluster slots back to the store) has no caller context
		return started{existing: existing}, err
	}
	rn.ticket = tk
	lctx, events := ctx, detailNone
	if req.attached {
		lctx, events = withRunChaos(ctx), req.events
	}
	root, sub := s.launch(lctx, rn, nil, events)
	return started{rn: rn, root: root, sub: sub}, nil
}

// validate checks a run's task, model and input and returns the model to run.
func (s *Server) validate(task, model string, in *orchestratorv1.RunInput) (string, error) {
	if model == "" {
		model = s.cfg.Loop.ModelName
	}
	if model == "" {
		model = agent.DefaultModel
	}
	if task == "" && (model == agent.DefaultModel || len(in.GetMessages()) == 0) {
		return "", status.Error(codes.InvalidArgument, "task is required")
	}
	if err := validateInput(task, model, in, s.maxSteps()); err != nil {
		return "", err
	}
	if model == agent.DefaultModel {
		if !plan.LooksLikePlan(task) {
			return "", status.Error(codes.InvalidArgument, "the sim model takes a JSON plan as its task (see docs/plan.md)")
		}
		if _, err := plan.Parse([]byte(task)); err != nil {
			return "", status.Error(codes.InvalidArgument, err.Error())
		}
	}
	return model, nil
}

// runDeadline is a new run's absolute deadline: timeout from now, capped at MaxRunTime,
// or the call's own deadline (the server chain always sets one) when timeout is 0. A run
// with less than MinRunTime left is refused DEADLINE_EXCEEDED.
func (s *Server) runDeadline(ctx context.Context, timeout time.Duration) (time.Time, error) {
	if timeout == 0 {
		dl, _ := ctx.Deadline()
		return dl, deadline.Check(ctx, s.cfg.MinRunTime, "run")
	}
	dl := time.Now().Add(min(timeout, s.cfg.MaxRunTime))
	if left := time.Until(dl); left < s.cfg.MinRunTime {
		return dl, status.Errorf(codes.DeadlineExceeded, "no time left to start run: %v left, needs %v", left.Round(time.Millisecond), s.cfg.MinRunTime)
	}
	return dl, nil
}

// create records a new run, owned by this process, and returns it, not yet launched.
// With an idempotency key that names an existing run of the tenant it creates nothing
// and returns that run instead (rn is nil).
func (s *Server) create(ctx context.Context, tenant, key, model, task string, in *orchestratorv1.RunInput, dl time.Time) (rn *run, existing *orchestratorv1.Run, err error) {
	if err := s.checkTenantDeadline(tenant, dl); err != nil {
		return nil, nil, err
	}
	began := time.Now()
	r, created, err := s.createRun(ctx, store.NewRun{Tenant: tenant, IdempotencyKey: key, Task: []byte(task),
		Model: model, Input: encodeInput(in), Deadline: dl, Owner: s.cfg.Owner, LeaseTTL: s.cfg.LeaseTTL,
		StartedBy: apikey.Caller(ctx)})
	if err != nil {
		return nil, nil, runStoreErr(ctx, s.cfg.Log, "create run", "", err)
	}
	if !created {
		if string(r.Task) != task || r.Model != model || !sameInput(decodeInput(r.Input), in) {
			return nil, nil, status.Errorf(codes.AlreadyExists, "idempotency key %q already started run %s with another input (task, model or other fields)", key, r.RunID)
		}
		return nil, s.fromStore(ctx, r), nil
	}
	if time.Since(began) > s.cfg.LeaseTTL/3 {
		// A slow store ate into the new lease before the heartbeats know the run: extend
		// it now rather than let another orchestrator claim a run that is starting.
		if l, err := s.cfg.Store.HeartbeatRun(ctx, r.Lease(), s.cfg.LeaseTTL); err == nil {
			r.LeaseExpires = l.Expires
		}
	}
	r.Deadline = dl // exactly as fixed on arrival: the store may keep it less precisely
	rn = newRun(r)
	rn.reaches = 1 << reportModel // a new run: its loop's nodes say where else it goes
	return rn, nil, nil
}

// launch starts rn in the background, resuming from prior (the journal of an earlier
// owner), and returns its root node as it started and a subscription to the run's
// events of detail events, made before the run started (nil for detailNone).
//
//nolint:contextcheck // the run's context is deliberately not derived from the call's (see below)
func (s *Server) launch(ctx context.Context, rn *run, prior []agent.Entry, events detail) (*meshv1.Node, chan *orchestratorv1.RunResponse) {
	ident := md.IdentityFrom(ctx)
	ident.Tenant, ident.RunID, ident.NodeID = rn.rec.GetTenant(), rn.id, RootNode
	// The run's admission pool travels on every child call (curfew-pool), so that
	// modelproxy can drain one pool's decoders; never the caller's own claim of one.
	ident.Pool = ""
	if rn.ticket != nil {
		ident.Pool = rn.ticket.Pool()
	}
	rn.orphan = chaos.From(ctx).Orphan
	// The run lives on its own context: detached from the call (so that
	// continue_on_disconnect works and the disconnect is seen as a cause, not an error),
	// bounded by the same absolute deadline, cancelled with a cause. It carries only the
	// run's identity, not the call's values: those (the call's stream, metadata and peer)
	// would stay reachable for the whole run after a detached client's call has ended.
	rctx, cancelDL := context.WithDeadlineCause(md.WithIdentity(context.Background(), ident), rn.dl, cancel.ErrDeadline)
	rctx, cancelRun := context.WithCancelCause(rctx)
	rctx, span := tracing.StartRun(ctx, rctx, ident)
	rn.cancel, rn.span = cancelRun, span
	root := s.nodes.Start(rn.id, &meshv1.Node{Id: RootNode, Kind: meshv1.NodeKind_NODE_KIND_RUN, Name: "run", Deadline: timestamppb.New(rn.dl)})
	rn.broadcast = func(cause error, decodersFirst bool) { s.broadcast(rctx, rn.id, cause, decodersFirst) }
	s.add(rn)
	s.logStarted(ctx, rn, rn.rec.GetModel(), rn.rec.GetTask())
	sub := rn.subscribe(events)
	var j agent.Journal
	if s.shared {
		// Checkpoints are for another orchestrator to resume from: a private store has
		// none, and a run on it is not parked on an open breaker either (runLoop).
		j = &runJournal{s: s, rn: rn, prior: prior, next: len(prior)}
	}
	in := loopInput(rn.rec.GetModel(), rn.rec.GetTask(), rn.rec.GetInput())
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer cancelDL()
		s.execute(rctx, rn, in, j)
	}()
	return root, sub
}

// withRunChaos returns ctx with the chaos settings (package chaos; empty unless the
// orchestrator runs with --chaos) that the run's children receive: drop-cancel, seed 003's
// "drop the cancel event on overflow workers only", goes to sheddable runs only.
func withRunChaos(ctx context.Context) context.Context {
	id := md.IdentityFrom(ctx)
	if id.Chaos == "" {
		return ctx
	}
	cs := chaos.From(ctx)
	if !cs.DropCancel {
		return ctx
	}
	if v := metadata.ValueFromIncomingContext(ctx, md.Criticality); len(v) > 0 {
		if c, err := admission.ParseCriticality(v[0]); err == nil && c == admission.Sheddable {
			return ctx
		}
	}
	cs.DropCancel = false
	id.Chaos = cs.String()
	return md.WithIdentity(ctx, id)
}
