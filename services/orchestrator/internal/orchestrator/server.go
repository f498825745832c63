package orchestrator

import (
	"context"
	"errors"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// Defaults of Config's zero fields.
const (
	DefaultMaxRuns    = 10000
	DefaultMinRunTime = 100 * time.Millisecond
	// RootNode is the id of every run's root node.
	RootNode = "root"
	// eventBuffer is the per-subscriber buffer of progress events; a slow client loses
	// progress events (never the summary) rather than slowing the run.
	eventBuffer = 256
)

// Config configures a Server.
type Config struct {
	// Loop reaches modelproxy and toolrunner; its Emit and Notes are set per run.
	Loop agent.Config
	// Reports are the NodeReportServices of modelproxy, toolrunner and subagent, read to
	// assemble summaries and told to cancel a run's nodes. The first is modelproxy's, the
	// decoders': a cancel tells it first (see cancelWith).
	Reports []meshv1.NodeReportServiceClient
	// MaxRuns is how many runs are kept in memory; DefaultMaxRuns when 0.
	MaxRuns int
	// MinRunTime is the least time left to admit a run; DefaultMinRunTime when 0.
	MinRunTime time.Duration
	// SettleTimeout bounds the wait for the tree's teardown when a run ends;
	// cancel.DefaultSettleTimeout when 0.
	SettleTimeout time.Duration
	Log           *slog.Logger
	// LogPrompts logs each run's task (its prompt) when it starts; off by default.
	LogPrompts bool
	// MaxRunTime caps a StartRun timeout; deadline.DefaultMax when 0.
	MaxRunTime time.Duration

	// Store, when set, makes runs durable: every run is recorded and leased in it, every
	// agent step is checkpointed, and runs whose owner died are resumed (see durable.go).
	// nil keeps runs in this process's memory only.
	Store store.Store
	// Owner names this process incarnation in run leases; required with Store. Name it
	// with OwnerName to give other orchestrators its address for CancelRun forwarding.
	Owner string
	// Peers, when set with a Store, returns a client of the orchestrator at addr (an
	// owner's address, see OwnerName): a CancelRun of a run another orchestrator owns is
	// forwarded to it (cancelfwd.go). Without it such a cancel reaches only the run's
	// leaves and is kept for a takeover.
	Peers func(addr string) (orchestratorv1.OrchestratorServiceClient, error)
	// LeaseTTL is how long a run's lease lasts without a heartbeat; DefaultLeaseTTL when
	// 0. The owner heartbeats every third of it. A dead owner's runs are taken over
	// about LeaseTTL after its last heartbeat.
	LeaseTTL time.Duration
	// DeadLetters, when set, records runs that fail for good (mesh/dlq.Recorder).
	DeadLetters DeadLetterRecorder
	// Registerer, when set with a Store, receives the run-lease metrics.
	Registerer prometheus.Registerer
	// Admission, when set, admits every new run (see admission.go); nil admits all.
	Admission *admission.Controller
}

// Server implements OrchestratorService.
type Server struct {
	orchestratorv1.UnimplementedOrchestratorServiceServer
	cfg   Config
	nodes *nodes.Table

	mu    sync.Mutex
	runs  map[string]*runState
	order []string // run ids, oldest first (sorted: UUIDv7)
	// keys maps tenant and StartRun idempotency key to a run id, without a Store.
	keys map[string]string
	wg   sync.WaitGroup
	// The lease loops of Start: heartbeats and takeovers, each stopped on its own.
	bg                          sync.WaitGroup
	stopHeartbeat, stopTakeover context.CancelFunc
	leaseMetrics                *leaseMetrics // nil without a Store or a Registerer

	// The drain (drain.go): draining is set when it begins; the runs still here at
	// handoverAt are handed over (cancelled without a Store), and handoff is closed then.
	draining    atomic.Bool
	drainOnce   sync.Once
	drainBy     time.Time // the stop deadline the drain was given
	handoverAt  time.Time
	handoff     chan struct{}
	handoffOnce sync.Once
	handedOver  int // runs handed over (cancelled without a Store) at handoff

	// cancels are the runs owned elsewhere whose CancelRun could not reach their owner,
	// with when: a takeover of one here ends it cancelled (cancelfwd.go).
	cancels map[string]time.Time
}

// New returns a server.
func New(cfg Config) *Server {
	if cfg.MaxRuns == 0 {
		cfg.MaxRuns = DefaultMaxRuns
	}
	if cfg.MinRunTime == 0 {
		cfg.MinRunTime = DefaultMinRunTime
	}
	if cfg.SettleTimeout == 0 {
		cfg.SettleTimeout = cancel.DefaultSettleTimeout
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.MaxRunTime == 0 {
		cfg.MaxRunTime = deadline.DefaultMax
	}
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	s := &Server{cfg: cfg, nodes: nodes.New(0), runs: map[string]*runState{}, keys: map[string]string{}, handoff: make(chan struct{})}
	if cfg.Store != nil && cfg.Registerer != nil {
		s.leaseMetrics = newLeaseMetrics(cfg.Registerer, s)
	}
	return s
}

// Wait blocks until every run's background work has finished.
func (s *Server) Wait() { s.wg.Wait() }

type runState struct {
	id       string
	dl       time.Time
	cancel   context.CancelCauseFunc
	done     chan struct{}
	mu       sync.Mutex
	rec      *orchestratorv1.Run
	cancelAt time.Time // first explicit cancel instant
	// broadcast tells the executors to cancel the run's nodes (one hop), beside the
	// RST_STREAM that travels down the tree hop by hop: with decodersFirst, modelproxy
	// first, waiting for its answer up to decoderWait, and then the rest; otherwise all
	// at once. It returns when the rest may go on (the other executors are told in the
	// background).
	broadcast   func(cause error, decodersFirst bool)
	broadcasted bool
	subs        map[chan *orchestratorv1.RunResponse]struct{} // nil when there are none
	// span is the run's span (package tracing): every call the run makes is its child.
	span trace.Span

	// With a Store (all guarded by mu): the run's lease, and why this process stopped
	// advancing the run without ending it.
	lease     store.Lease
	finishing bool // the result is being committed: heartbeats no longer matter
	lost      bool // another orchestrator claimed the run
	handover  bool // shutting down: release the lease for another orchestrator

	// orphan is the chaos setting orphan (a drill's naive baseline): a client's
	// disconnect or an operator's cancel is recorded but not acted on.
	orphan bool

	// ticket is the run's admission, released when the run ends here (nil: not admitted
	// by this process, as a run taken over from a dead owner).
	ticket *admission.Ticket
}

func (rs *runState) publish(ev *orchestratorv1.RunResponse) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	for c := range rs.subs {
		select {
		case c <- ev:
		default: // slow subscriber: drop progress, the summary carries everything
		}
	}
}

func (rs *runState) subscribe() chan *orchestratorv1.RunResponse {
	c := make(chan *orchestratorv1.RunResponse, eventBuffer)
	rs.mu.Lock()
	if rs.subs == nil {
		rs.subs = map[chan *orchestratorv1.RunResponse]struct{}{}
	}
	rs.subs[c] = struct{}{}
	rs.mu.Unlock()
	return c
}

func (rs *runState) unsubscribe(c chan *orchestratorv1.RunResponse) {
	rs.mu.Lock()
	delete(rs.subs, c)
	if len(rs.subs) == 0 {
		rs.subs = nil // a detached run outlives its last client: hold no map for it
	}
	rs.mu.Unlock()
}

// cancelWith records the cancel instant (the first one wins) and cancels the tree, the
// decoders first. A deadline cancel's instant is never later than the deadline itself.
//
// The decoders first: modelproxy is told to cancel the run's decoders, and only once it
// has answered that they have ended (or decoderWait has passed) is the run's context
// cancelled, which starts
// the hop-by-hop teardown of the rest of the tree, and are toolrunner and subagent told.
// That teardown is tens of milliseconds of CPU across the services at 64 leaves; begun
// at the same time, it kept modelproxy from reading the broadcast for up to several
// milliseconds on two cores, while its decoders went on spending tokens
// (docs/benchmarks.md, section 1). The loops above a decoder that stops first see its
// CANCELLED while their own context is still alive; they take it for the run's cancel on
// its way and wait for it (cancel.AwaitWindow), so every node still records the run's
// cause, not a failed sibling.
func (rs *runState) cancelWith(cause error) { rs.cancelTree(cause, true) }

// cancelTree is cancelWith; decodersFirst false tells every executor at once without
// waiting (a drain cancelling every run).
func (rs *runState) cancelTree(cause error, decodersFirst bool) {
	rs.mu.Lock()
	if rs.cancelAt.IsZero() {
		rs.cancelAt = time.Now()
		if errors.Is(cause, cancel.ErrDeadline) && rs.cancelAt.After(rs.dl) {
			rs.cancelAt = rs.dl
		}
	}
	first := !rs.broadcasted
	rs.broadcasted = true
	rs.mu.Unlock()
	if first && rs.broadcast != nil {
		rs.broadcast(cause, decodersFirst)
	}
	rs.cancel(cause)
}

// markCancel records the cancel instant (the first one wins) without cancelling
// anything: the chaos setting orphan, whose summary still splits tokens at the instant
// the client left.
func (rs *runState) markCancel() {
	rs.mu.Lock()
	if rs.cancelAt.IsZero() {
		rs.cancelAt = time.Now()
	}
	rs.mu.Unlock()
}

// snapshot copies the run's record; its epoch is the lease's (0 without a store).
func (rs *runState) snapshot() *orchestratorv1.Run {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	r := proto.Clone(rs.rec).(*orchestratorv1.Run)
	r.Epoch = rs.lease.Epoch
	return r
}

// Run implements OrchestratorService.Run.
func (s *Server) Run(req *orchestratorv1.RunRequest, stream orchestratorv1.OrchestratorService_RunServer) error {
	ctx := stream.Context()
	rs, root, sub, err := s.start(ctx, req)
	if err != nil {
		return err
	}
	defer rs.unsubscribe(sub)
	if c := md.IdentityFrom(ctx).Chaos; c != "" {
		// Tells a drill that this orchestrator honours its chaos settings (--chaos).
		_ = stream.SetHeader(metadata.Pairs(md.Chaos, c))
	}
	if err := stream.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Started{Started: &orchestratorv1.RunStarted{
		RunId: rs.id, Deadline: timestamppb.New(rs.dl)}}}); err != nil {
		s.disconnected(ctx, rs, req)
		return err
	}
	if err := stream.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Node{Node: root}}); err != nil {
		s.disconnected(ctx, rs, req)
		return err
	}
	for {
		select {
		case ev := <-sub:
			if err := stream.Send(ev); err != nil {
				s.disconnected(ctx, rs, req)
				return err
			}
		case <-rs.done:
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
			if err := rs.movedErr(); err != nil {
				return err
			}
			run := rs.snapshot()
			if err := stream.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Finished{Finished: run}}); err != nil {
				return err
			}
			return runErr(run)
		case <-ctx.Done():
			s.disconnected(ctx, rs, req)
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// disconnected handles the end of a Run call's stream before its run ended.
func (s *Server) disconnected(ctx context.Context, rs *runState, req *orchestratorv1.RunRequest) {
	if req.GetContinueOnDisconnect() || rs.moved() {
		// A run that moved is another orchestrator's now: its nodes may be that one's,
		// and a cancel here would reach them.
		return
	}
	if rs.orphan {
		rs.markCancel()
		return
	}
	// A client whose own deadline expired cancels its call a little before the server's
	// copy of the deadline fires (the server measured it from arrival); that is the
	// deadline, not a disconnect.
	if errors.Is(ctx.Err(), context.DeadlineExceeded) || time.Until(rs.dl) <= cancel.DeadlineSlop {
		rs.cancelWith(cancel.ErrDeadline)
		return
	}
	rs.cancelWith(cancel.ErrClientDisconnect)
}

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

// validate checks a run's task and model and returns the model to run.
func (s *Server) validate(task, model string) (string, error) {
	if model == "" {
		model = s.cfg.Loop.ModelName
	}
	if model == "" {
		model = agent.DefaultModel
	}
	if task == "" {
		return "", status.Error(codes.InvalidArgument, "task is required")
	}
	if model == agent.DefaultModel {
		if !plan.LooksLikePlan(task) {
			return "", status.Error(codes.InvalidArgument, "the sim model takes a JSON plan as its task (see the README's plan format)")
		}
		if _, err := plan.Parse([]byte(task)); err != nil {
			return "", status.Error(codes.InvalidArgument, err.Error())
		}
	}
	return model, nil
}

// start validates a Run request and starts its run in the background. It returns the
// root node as it started, for the caller's second event. The returned subscription
// exists before the run starts, so that no event is missed.
func (s *Server) start(ctx context.Context, req *orchestratorv1.RunRequest) (*runState, *meshv1.Node, chan *orchestratorv1.RunResponse, error) {
	model, err := s.validate(req.GetTask(), req.GetModel())
	if err != nil {
		return nil, nil, nil, err
	}
	if s.draining.Load() {
		return nil, nil, nil, errDraining()
	}
	if err := deadline.Check(ctx, s.cfg.MinRunTime, "run"); err != nil {
		return nil, nil, nil, err
	}
	dl, _ := ctx.Deadline() // the server chain always sets one
	tk, err := s.admit(ctx, model, req.GetTask())
	if err != nil {
		return nil, nil, nil, err
	}
	rs, _, err := s.create(ctx, md.IdentityFrom(ctx).Tenant, "", model, req.GetTask(), dl)
	if err != nil {
		tk.Release(admission.Outcome{Ended: admission.EndFailed})
		return nil, nil, nil, err
	}
	rs.ticket = tk
	root, sub := s.launch(withRunChaos(ctx), rs, nil, true)
	return rs, root, sub, nil
}

// newRunState returns the in-memory state of a run, not yet started.
func newRunState(id, tenant, key, model, task string, dl, created time.Time) *runState {
	return &runState{
		id: id, dl: dl, done: make(chan struct{}),
		rec: &orchestratorv1.Run{RunId: id, Tenant: tenant, Status: orchestratorv1.RunStatus_RUN_STATUS_RUNNING,
			Deadline: timestamppb.New(dl), CreatedAt: timestamppb.New(created), Model: model, Task: task, IdempotencyKey: key},
	}
}

// create records a new run, owned by this process, and returns its state, not yet
// launched. With an idempotency key that names an existing run of the tenant it creates
// nothing and returns that run instead (rs is nil).
func (s *Server) create(ctx context.Context, tenant, key, model, task string, dl time.Time) (rs *runState, existing *orchestratorv1.Run, err error) {
	if err := s.checkTenantDeadline(tenant, dl); err != nil {
		return nil, nil, err
	}
	if s.cfg.Store == nil {
		if key != "" {
			s.mu.Lock()
			id, ok := s.keys[tenant+"\x00"+key]
			s.mu.Unlock()
			if ok {
				if old, err := s.get(id); err == nil {
					r := old.snapshot()
					if r.GetTask() != task || r.GetModel() != model {
						return nil, nil, status.Errorf(codes.AlreadyExists, "idempotency key %q already started run %s with another task or model", key, id)
					}
					return nil, r, nil
				}
			}
		}
		id, err := uuid.NewV7()
		if err != nil {
			return nil, nil, status.Error(codes.Internal, "internal error")
		}
		rs := newRunState(id.String(), tenant, key, model, task, dl, time.Now())
		if key != "" {
			s.mu.Lock()
			if other, ok := s.keys[tenant+"\x00"+key]; ok { // a concurrent start won
				s.mu.Unlock()
				if old, err := s.get(other); err == nil {
					return nil, old.snapshot(), nil
				}
				return nil, nil, status.Error(codes.Aborted, "a concurrent StartRun with this key is starting; retry")
			}
			s.keys[tenant+"\x00"+key] = rs.id
			s.mu.Unlock()
		}
		return rs, nil, nil
	}
	began := time.Now()
	run, created, err := s.cfg.Store.CreateRun(ctx, store.NewRun{Tenant: tenant, IdempotencyKey: key, Task: []byte(task),
		Model: model, Deadline: dl, Owner: s.cfg.Owner, LeaseTTL: s.cfg.LeaseTTL})
	if err != nil {
		return nil, nil, runStoreErr(ctx, s.cfg.Log, "create run", err)
	}
	if created && time.Since(began) > s.cfg.LeaseTTL/3 {
		// A slow store ate into the new lease before the heartbeats know the run: extend
		// it now rather than let another orchestrator claim a run that is starting.
		if l, err := s.cfg.Store.HeartbeatRun(ctx, run.Lease(), s.cfg.LeaseTTL); err == nil {
			run.LeaseExpires = l.Expires
		}
	}
	if !created {
		if string(run.Task) != task || run.Model != model {
			return nil, nil, status.Errorf(codes.AlreadyExists, "idempotency key %q already started run %s with another task or model", key, run.RunID)
		}
		return nil, s.fromStore(ctx, run), nil
	}
	rs = newRunState(run.RunID, tenant, key, model, task, dl, run.CreatedAt)
	rs.lease = run.Lease()
	return rs, nil, nil
}

// launch starts rs in the background, resuming from prior (the journal of an earlier
// owner), and returns its root node as it started and, when subscribe is set, a
// subscription made before the run started.
//
//nolint:contextcheck // the run's context is deliberately not derived from the call's (see below)
func (s *Server) launch(ctx context.Context, rs *runState, prior []agent.Entry, subscribe bool) (*meshv1.Node, chan *orchestratorv1.RunResponse) {
	ident := md.IdentityFrom(ctx)
	ident.Tenant, ident.RunID, ident.NodeID = rs.rec.GetTenant(), rs.id, RootNode
	rs.orphan = chaos.From(ctx).Orphan
	// The run lives on its own context: detached from the call (so that
	// continue_on_disconnect works and the disconnect is seen as a cause, not an error),
	// bounded by the same absolute deadline, cancelled with a cause. It carries only the
	// run's identity, not the call's values: those (the call's stream, metadata and peer)
	// would stay reachable for the whole run after a detached client's call has ended.
	rctx, cancelDL := context.WithDeadlineCause(md.WithIdentity(context.Background(), ident), rs.dl, cancel.ErrDeadline)
	rctx, cancelRun := context.WithCancelCause(rctx)
	rctx, span := tracing.StartRun(ctx, rctx, ident)
	rs.cancel, rs.span = cancelRun, span
	root := s.nodes.Start(rs.id, &meshv1.Node{Id: RootNode, Kind: meshv1.NodeKind_NODE_KIND_RUN, Name: "run", Deadline: timestamppb.New(rs.dl)})
	rs.broadcast = func(cause error, decodersFirst bool) {
		first := 0
		if decodersFirst && len(s.cfg.Reports) > 1 {
			first = 1
			decoders := make(chan struct{})
			s.wg.Add(1)
			go func() {
				defer s.wg.Done()
				defer close(decoders)
				s.broadcastCancel(rctx, rs.id, cause, decoderWait, s.cfg.Reports[:1])
			}()
			t := time.NewTimer(decoderWait)
			select {
			case <-decoders:
			case <-t.C:
			}
			t.Stop()
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.broadcastCancel(rctx, rs.id, cause, 0, s.cfg.Reports[first:])
		}()
	}
	s.add(rs)
	s.logStarted(ctx, rs, rs.rec.GetModel(), rs.rec.GetTask())
	var sub chan *orchestratorv1.RunResponse
	if subscribe {
		sub = rs.subscribe()
	}
	var j agent.Journal
	if s.cfg.Store != nil {
		j = &runJournal{s: s, rs: rs, prior: prior, next: len(prior)}
	}
	model, task := rs.rec.GetModel(), rs.rec.GetTask()
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer cancelDL()
		s.execute(rctx, rs, model, task, j)
	}()
	return root, sub
}

func (s *Server) add(rs *runState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runs[rs.id] = rs
	// Keep order sorted by id (UUIDv7: creation time), which ListRuns pages by; ids minted
	// concurrently may arrive here a little out of order.
	i := sort.SearchStrings(s.order, rs.id)
	s.order = append(s.order, "")
	copy(s.order[i+1:], s.order[i:])
	s.order[i] = rs.id
	// Forget the oldest ended runs beyond MaxRuns; running runs are never forgotten, so a
	// long detached run does not stop older ended ones from being dropped.
	excess := len(s.order) - s.cfg.MaxRuns
	if excess <= 0 {
		return
	}
	kept := s.order[:0]
	for _, id := range s.order {
		if excess > 0 {
			select {
			case <-s.runs[id].done:
				if k := s.runs[id].rec.GetIdempotencyKey(); k != "" && s.cfg.Store == nil {
					delete(s.keys, s.runs[id].rec.GetTenant()+"\x00"+k) // the key goes with its run
				}
				delete(s.runs, id)
				excess--
				continue
			default:
			}
		}
		kept = append(kept, id)
	}
	s.order = kept
}

// execute runs the loop, then ends the root node, waits for the tree's teardown,
// assembles the summary and publishes it.
func (s *Server) execute(rctx context.Context, rs *runState, model, task string, j agent.Journal) {
	lc := s.cfg.Loop
	lc.Notes = s.nodes
	lc.Emit = func(n *meshv1.Node) {
		rs.publish(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Node{Node: n}})
	}
	answer, err := s.runLoop(rctx, rs, agent.New(lc), model, task, j)
	if rs.moved() {
		s.abandon(rctx, rs)
		return
	}
	o := nodes.OutcomeOf(rctx, err)
	if o.Status == meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED {
		o.Cause = meshv1.CancelCause_CANCEL_CAUSE_DEADLINE
	}
	rs.mu.Lock()
	cancelAt := rs.cancelAt
	rs.mu.Unlock()
	if cancelAt.IsZero() && o.Cause == meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
		// Stopped by the deadline. The child's DEADLINE_EXCEEDED (its own copy of the
		// deadline, or a fast-fail) can arrive before rctx's timer has fired, so do not
		// require rctx.Err(); the instant is the deadline, or now if that is earlier.
		cancelAt = rs.dl
		if now := time.Now(); now.Before(cancelAt) {
			cancelAt = now
		}
	}
	root := s.nodes.End(rs.id, RootNode, o.Status, o.Cause, o.Code, o.Message, func(n *meshv1.Node) {
		if !cancelAt.IsZero() {
			n.CancelledAt = timestamppb.New(cancelAt)
		}
	})
	rs.cancel(nil) // release the run context; children have ended
	lc.Emit(root)

	cctx, stop := context.WithTimeout(context.WithoutCancel(rctx), s.cfg.SettleTimeout+2*time.Second)
	ns := s.collect(cctx, rs.id, cancelAt, s.cfg.SettleTimeout)
	stop()

	rs.mu.Lock()
	r := rs.rec
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
	rs.finishing = true
	rs.mu.Unlock()
	tracing.EndRun(rs.span, o.Status, o.Cause, o.Code, o.Message, tokens, after)
	s.settle(rs, rs.snapshot())
	if s.cfg.Store != nil && !s.commit(rctx, rs) {
		s.abandon(rctx, rs)
		return
	}
	close(rs.done)
	s.logFinished(rctx, rs.snapshot())
}

// broadcastTimeout bounds the one-hop cancel broadcast to the executors.
const broadcastTimeout = 2 * time.Second

// decoderWait bounds how long a cancel waits for modelproxy's answer, which comes once its
// decoders of the run have ended, before it cancels the rest of the tree (cancelWith): a
// modelproxy slower than this must not hold up the teardown.
const decoderWait = 5 * time.Millisecond

// broadcastCancel asks the executors of to to cancel the run's running nodes with cause
// and, with settle > 0, to answer once those have ended (at most settle later). The
// RST_STREAM path reaches them too, hop by hop; this reaches a decoder three subagents
// deep in one hop, and tells it the true cause.
func (s *Server) broadcastCancel(rctx context.Context, run string, cause error, settle time.Duration, to []meshv1.NodeReportServiceClient) {
	ctx, stop := context.WithTimeout(context.WithoutCancel(rctx), broadcastTimeout)
	defer stop()
	req := &meshv1.CancelNodesRequest{RunId: run, NodePrefixes: []string{RootNode}, Cause: cancel.FromError(cause)}
	if settle > 0 {
		req.SettleTimeout = durationpb.New(settle)
	}
	var wg sync.WaitGroup
	for _, c := range to {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.CancelNodes(ctx, req); err != nil {
				s.cfg.Log.WarnContext(ctx, "cancel broadcast failed; the RST_STREAM path still stops the tree", "run_id", run, "error", err.Error())
			}
		}()
	}
	wg.Wait()
}

func setNodes(r *orchestratorv1.Run, ns []*meshv1.Node) {
	r.Nodes = ns
	r.Tokens, r.TokensAfterCancel = 0, 0
	for _, n := range ns {
		r.Tokens += n.GetTokens()
		r.TokensAfterCancel += n.GetTokensAfterCancel()
	}
}

// collect merges this process's nodes of the run with every executor's report. With
// settle > 0 each executor first waits for the run's nodes to end.
func (s *Server) collect(ctx context.Context, run string, cancelAt time.Time, settle time.Duration) []*meshv1.Node {
	local, _ := s.nodes.List(ctx, run, nil, 0)
	reports := make([][]*meshv1.Node, len(s.cfg.Reports)+1)
	reports[0] = local
	req := &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(settle)}
	if !cancelAt.IsZero() {
		req.CancelAt = timestamppb.New(cancelAt)
	}
	var wg sync.WaitGroup
	for i, c := range s.cfg.Reports {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := c.ListNodes(ctx, req)
			if err != nil {
				s.cfg.Log.WarnContext(ctx, "node report unavailable; summary is incomplete", "run_id", run, "error", err.Error())
				return
			}
			if !resp.GetSettled() {
				s.cfg.Log.WarnContext(ctx, "nodes still running after the settle timeout", "run_id", run, "settle", settle)
			}
			reports[i+1] = resp.GetNodes()
		}()
	}
	wg.Wait()
	return nodes.Merge(reports...)
}

func runStatus(s meshv1.NodeStatus) orchestratorv1.RunStatus {
	switch s {
	case meshv1.NodeStatus_NODE_STATUS_SUCCEEDED:
		return orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED
	case meshv1.NodeStatus_NODE_STATUS_CANCELLED:
		return orchestratorv1.RunStatus_RUN_STATUS_CANCELLED
	case meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED:
		return orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED
	case meshv1.NodeStatus_NODE_STATUS_RUNNING:
		return orchestratorv1.RunStatus_RUN_STATUS_RUNNING
	}
	return orchestratorv1.RunStatus_RUN_STATUS_FAILED
}

func (s *Server) get(id string) (*runState, error) {
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "run_id is required")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	rs := s.runs[id]
	if rs == nil {
		return nil, status.Errorf(codes.NotFound, "run %q not found", id)
	}
	return rs, nil
}

// visible returns the run id this process holds if it belongs to the caller's tenant
// (md.IdentityFrom: authenticated by the server chain). Another tenant's run is
// NOT_FOUND, exactly like a run that does not exist, so that its existence does not leak.
func (s *Server) visible(ctx context.Context, id string) (*runState, error) {
	rs, err := s.get(id)
	if err != nil {
		return nil, err
	}
	if rs.rec.GetTenant() != md.IdentityFrom(ctx).Tenant { // rec's tenant is set once, at creation
		return nil, status.Errorf(codes.NotFound, "run %q not found", id)
	}
	return rs, nil
}

// GetRun implements OrchestratorService.GetRun. A running run's nodes are read live.
func (s *Server) GetRun(ctx context.Context, req *orchestratorv1.GetRunRequest) (*orchestratorv1.GetRunResponse, error) {
	rs, err := s.visible(ctx, req.GetRunId())
	if err != nil {
		if s.cfg.Store == nil || status.Code(err) != codes.NotFound {
			return nil, err
		}
		r, err := s.stored(ctx, req.GetRunId())
		if err != nil {
			return nil, err
		}
		return &orchestratorv1.GetRunResponse{Run: r}, nil
	}
	select {
	case <-rs.done:
		return &orchestratorv1.GetRunResponse{Run: rs.snapshot()}, nil
	default:
	}
	r := rs.snapshot()
	if r.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
		// Live: read the nodes from the executors. A run whose end is recorded but not yet
		// committed (its result is being stored) already holds its final summary, with
		// the token figures split at the cancel instant: a live read would lose the split.
		setNodes(r, s.collect(ctx, rs.id, time.Time{}, 0))
	}
	return &orchestratorv1.GetRunResponse{Run: r}, nil
}

// Paging limits of ListRuns.
const (
	DefaultPageSize = 50
	MaxPageSize     = 500
)

// ListRuns implements OrchestratorService.ListRuns: the caller's tenant's runs, newest
// first, without nodes. The page token is the id of the last run of the previous page;
// run ids are UUIDv7, ordered by creation, so pages stay stable while new runs arrive.
func (s *Server) ListRuns(ctx context.Context, req *orchestratorv1.ListRunsRequest) (*orchestratorv1.ListRunsResponse, error) {
	size := int(req.GetPageSize())
	switch {
	case size < 0:
		return nil, status.Error(codes.InvalidArgument, "page_size must not be negative")
	case size == 0:
		size = DefaultPageSize
	case size > MaxPageSize:
		size = MaxPageSize
	}
	after := req.GetPageToken()
	if after != "" {
		if _, err := uuid.Parse(after); err != nil {
			return nil, status.Error(codes.InvalidArgument, "page_token is not one this service issued")
		}
	}
	if s.cfg.Store != nil {
		return s.listStored(ctx, size, after)
	}
	tenant := md.IdentityFrom(ctx).Tenant
	s.mu.Lock()
	states := make([]*runState, 0, size+1)
	for i := len(s.order) - 1; i >= 0 && len(states) <= size; i-- {
		if id := s.order[i]; (after == "" || id < after) && s.runs[id].rec.GetTenant() == tenant {
			states = append(states, s.runs[id])
		}
	}
	s.mu.Unlock()
	resp := &orchestratorv1.ListRunsResponse{}
	for i, rs := range states {
		if i == size {
			resp.NextPageToken = resp.Runs[size-1].GetRunId()
			break
		}
		r := rs.snapshot()
		r.Nodes = nil
		resp.Runs = append(resp.Runs, r)
	}
	return resp, nil
}

// CancelRun implements OrchestratorService.CancelRun: it cancels the run with cause
// operator and returns once its tree has been torn down. Cancelling an ended run returns
// it unchanged.
func (s *Server) CancelRun(ctx context.Context, req *orchestratorv1.CancelRunRequest) (*orchestratorv1.CancelRunResponse, error) {
	rs, err := s.visible(ctx, req.GetRunId())
	if err != nil {
		if s.cfg.Store == nil || status.Code(err) != codes.NotFound {
			return nil, err
		}
		r, err := s.cancelElsewhere(ctx, req)
		if err != nil {
			return nil, err
		}
		return &orchestratorv1.CancelRunResponse{Run: r}, nil
	}
	r, err := s.cancelHere(ctx, rs, req)
	if err != nil {
		return nil, err
	}
	return &orchestratorv1.CancelRunResponse{Run: r}, nil
}

// cancelHere cancels a run this process holds and waits for its tree to stop.
func (s *Server) cancelHere(ctx context.Context, rs *runState, req *orchestratorv1.CancelRunRequest) (*orchestratorv1.Run, error) {
	select {
	case <-rs.done:
		return rs.snapshot(), nil
	default:
	}
	s.cfg.Log.InfoContext(ctx, "run cancelled by operator", "run_id", rs.id, "reason", req.GetReason())
	if rs.orphan {
		rs.markCancel()
	} else {
		rs.cancelWith(cancel.ErrOperator)
	}
	select {
	case <-rs.done:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	return rs.snapshot(), nil
}

// Sweep forgets the node records of runs that ended long ago.
func (s *Server) Sweep(now time.Time) { s.nodes.Sweep(now) }
