package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Durable runs. With a Store, a run is a row that one orchestrator at a time owns through
// a lease (owner, epoch, expiry; see store.Runs):
//   - the owner heartbeats every LeaseTTL/3 and checkpoints every agent step under its
//     lease, so a write from an owner that lost the run is refused (the epoch fences it);
//   - every orchestrator scans for runs whose lease expired (their owner died) and claims
//     them with a higher epoch, then resumes each from its journal: completed model steps
//     are not generated again, completed tools are not called again (and a tool cut off
//     mid-call is made safe to repeat by toolrunner's idempotency records);
//   - a run whose deadline passed while nobody owned it ends DEADLINE_EXCEEDED and
//     becomes a dead letter.

// DefaultLeaseTTL is Config.LeaseTTL's default.
const DefaultLeaseTTL = 10 * time.Second

// Bounds of the durable paths.
const (
	// maxTakeoverScan bounds the interval between two scans for expired leases: a dead
	// owner's run is taken over within LeaseTTL plus this, plus the claim.
	maxTakeoverScan = 500 * time.Millisecond
	// takeoverBatch is the most runs one scan claims.
	takeoverBatch = 16
	// storeTimeout bounds one store call made on a run's behalf after its context ended.
	storeTimeout = 5 * time.Second
	// storeAttempts is how often a checkpoint or the final commit is tried before the run
	// gives up (the store being briefly unreachable must not lose a run).
	storeAttempts = 3
	// watchPoll is how often WatchRun reads a run owned by another orchestrator.
	watchPoll = 250 * time.Millisecond
)

// DeadLetterRecorder records a run that failed for good; mesh/dlq.Recorder is one.
type DeadLetterRecorder interface {
	Record(ctx context.Context, d store.DeadLetter) (store.DeadLetter, bool, error)
}

// errLeaseLost stops a run this process no longer owns; errHandover one it gives up.
var (
	errLeaseLost = errors.New("another orchestrator claimed the run")
	errHandover  = errors.New("orchestrator shutting down: run handed over")
)

func (rs *runState) leaseNow() store.Lease {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.lease
}

// lose stops advancing the run: another owner has it. No cancel broadcast: the nodes the
// executors run under this run's ids may be the new owner's.
func (rs *runState) lose() {
	rs.mu.Lock()
	if rs.lost || rs.finishing {
		rs.mu.Unlock()
		return
	}
	rs.lost = true
	rs.mu.Unlock()
	rs.cancel(errLeaseLost)
}

// handOver stops advancing the run so that its lease can be released. It reports false
// when the run's result is already being committed: that run ends here.
func (rs *runState) handOver() bool {
	rs.mu.Lock()
	if rs.finishing {
		rs.mu.Unlock()
		return false
	}
	rs.handover = true
	rs.mu.Unlock()
	rs.cancel(errHandover)
	return true
}

// moved reports whether the run was lost or handed over.
func (rs *runState) moved() bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.lost || rs.handover
}

// movedErr is the status a Run stream ends with when its run moved to another
// orchestrator, nil otherwise.
func (rs *runState) movedErr() error {
	if !rs.moved() {
		return nil
	}
	return status.Errorf(codes.Unavailable, "run %s moved to another orchestrator; follow it with WatchRun", rs.id)
}

// Start begins the lease loops of a durable server: heartbeats for the runs it owns,
// and the takeover of runs whose owner died. It is a no-op without a Store. Shutdown
// stops them.
func (s *Server) Start(ctx context.Context) {
	if s.cfg.Store == nil {
		return
	}
	hctx, stopH := context.WithCancel(ctx)
	tctx, stopT := context.WithCancel(ctx)
	s.mu.Lock()
	s.stopHeartbeat, s.stopTakeover = stopH, stopT
	s.mu.Unlock()
	s.bg.Add(2)
	go func() { defer s.bg.Done(); s.heartbeats(hctx) }()
	go func() { defer s.bg.Done(); s.takeovers(tctx) }()
}

func (s *Server) stopTakeovers() {
	s.mu.Lock()
	stop := s.stopTakeover
	s.mu.Unlock()
	if stop != nil {
		stop()
	}
}

func (s *Server) stopLeases() {
	s.mu.Lock()
	stop := s.stopHeartbeat
	s.mu.Unlock()
	s.stopTakeovers()
	if stop != nil {
		stop()
	}
	s.bg.Wait()
}

// heartbeats extends the leases of the runs this process owns every LeaseTTL/3.
func (s *Server) heartbeats(ctx context.Context) {
	t := time.NewTicker(s.cfg.LeaseTTL / 3)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		// A few at a time: one slow round trip must not make the others' leases lapse.
		sem := make(chan struct{}, heartbeatParallel)
		var wg sync.WaitGroup
		for _, rs := range s.live() {
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer func() { <-sem; wg.Done() }()
				s.heartbeat(ctx, rs)
			}()
		}
		wg.Wait()
	}
}

// heartbeatParallel is how many heartbeats one round sends at once.
const heartbeatParallel = 8

// heartbeat extends the run's lease; a lease found lost stops the run here.
func (s *Server) heartbeat(ctx context.Context, rs *runState) {
	rs.mu.Lock()
	l, skip := rs.lease, rs.finishing || rs.lost || rs.handover
	rs.mu.Unlock()
	if skip || l.Epoch == 0 {
		return
	}
	nl, err := s.cfg.Store.HeartbeatRun(ctx, l, s.cfg.LeaseTTL)
	switch {
	case err == nil:
		rs.mu.Lock()
		if rs.lease.Epoch == nl.Epoch {
			rs.lease = nl
		}
		rs.mu.Unlock()
	case errors.Is(err, store.ErrStaleEpoch), errors.Is(err, store.ErrRunFinished), errors.Is(err, store.ErrNotFound):
		rs.mu.Lock()
		current := rs.lease.Epoch == l.Epoch // not reclaimed by this process meanwhile
		rs.mu.Unlock()
		if current {
			s.cfg.Log.WarnContext(ctx, "run lease lost; this orchestrator stops advancing the run", "run_id", rs.id, "epoch", l.Epoch, "error", err.Error())
			rs.lose()
		}
	case ctx.Err() != nil:
	default:
		s.cfg.Log.WarnContext(ctx, "run heartbeat failed; retrying", "run_id", rs.id, "error", err.Error())
	}
}

// live returns the runs of this process that have not ended.
func (s *Server) live() []*runState {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*runState
	for _, rs := range s.runs {
		select {
		case <-rs.done:
		default:
			out = append(out, rs)
		}
	}
	return out
}

// takeovers claims runs whose lease expired, at once and then every scan interval.
func (s *Server) takeovers(ctx context.Context) {
	every := min(s.cfg.LeaseTTL/4, maxTakeoverScan)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		for {
			runs, err := s.cfg.Store.ClaimExpiredRuns(ctx, s.cfg.Owner, s.cfg.LeaseTTL, takeoverBatch)
			if err != nil {
				if ctx.Err() == nil {
					s.cfg.Log.WarnContext(ctx, "scan for runs to take over failed", "error", err.Error())
				}
				break
			}
			for _, r := range runs {
				s.resume(ctx, r)
			}
			if len(runs) < takeoverBatch {
				break
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// resume continues a run this process has just claimed: from its journal when it still
// has time, else it ends DEADLINE_EXCEEDED as a dead letter.
func (s *Server) resume(ctx context.Context, r store.Run) {
	log := s.cfg.Log.With("run_id", r.RunID, "epoch", r.Epoch)
	if rs, err := s.get(r.RunID); err == nil && !rs.moved() {
		// This process's own run, whose lease lapsed before a heartbeat (a stalled
		// store, say): the claim made this process its owner again, under a new epoch.
		// The run goes on, writing under the new lease.
		rs.mu.Lock()
		rs.lease = r.Lease()
		rs.mu.Unlock()
		log.WarnContext(ctx, "run's lease lapsed before its heartbeat; reclaimed it")
		return
	}
	if s.draining.Load() {
		// A scan that raced the drain: give the run straight back for another
		// orchestrator to take.
		err := retryStore(ctx, func(ctx context.Context) error { return s.cfg.Store.ReleaseRun(ctx, r.Lease()) })
		if err != nil && !fenced(err) {
			log.WarnContext(ctx, "draining: could not release a run claimed during the drain; it is taken over when its lease expires", "error", err.Error())
			return
		}
		log.InfoContext(ctx, "draining: released a run claimed during the drain")
		return
	}
	if s.cancelRequested(r.RunID) {
		s.endCancelled(ctx, r)
		return
	}
	if !time.Now().Before(r.Deadline) {
		log.WarnContext(ctx, "run's deadline passed while no orchestrator owned it")
		rs := newRunState(r.RunID, r.Tenant, r.IdempotencyKey, r.Model, string(r.Task), r.Deadline, r.CreatedAt)
		rs.lease = r.Lease()
		rec := rs.rec
		rec.Status, rec.Cause = orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED, meshv1.CancelCause_CANCEL_CAUSE_DEADLINE
		rec.ErrorCode, rec.ErrorMessage = "DEADLINE_EXCEEDED", "the run's deadline passed while no orchestrator owned it"
		rec.EndedAt, rec.CancelledAt = timestamppb.Now(), timestamppb.New(r.Deadline)
		if s.commit(ctx, rs) {
			s.leaseMetrics.takeover(takeoverDeadline)
			s.deadLetter(ctx, rs.snapshot(), "deadline_exceeded")
		}
		return
	}
	cps, err := s.cfg.Store.ListCheckpoints(ctx, r.Tenant, r.RunID)
	var prior []agent.Entry
	for _, c := range cps {
		if err != nil {
			break
		}
		b := c.ModelOutput
		if len(b) == 0 {
			b = c.ToolResults
		}
		var e agent.Entry
		e, err = agent.UnmarshalEntry(b)
		e.Seq, e.Tokens = c.Step, c.Tokens
		if e.Seq != len(prior) {
			err = errors.New("checkpoints are not contiguous")
		}
		prior = append(prior, e)
	}
	if err != nil {
		// Not resumable here; leave the lease to expire and say so: another orchestrator
		// (or this one, later) tries again.
		log.ErrorContext(ctx, "cannot read the run's checkpoints; not resuming it", "error", err.Error())
		return
	}
	rs := newRunState(r.RunID, r.Tenant, r.IdempotencyKey, r.Model, string(r.Task), r.Deadline, r.CreatedAt)
	rs.lease = r.Lease()
	log.InfoContext(ctx, "resuming run", "checkpoints", len(prior), "time_left_ms", time.Until(r.Deadline).Milliseconds())
	s.leaseMetrics.takeover(takeoverResumed)
	s.launch(md.WithIdentity(ctx, md.Identity{Tenant: r.Tenant}), rs, prior, false)
}

// runJournal is a run's agent journal in the store: each entry is a checkpoint, written
// under the run's lease.
type runJournal struct {
	s     *Server
	rs    *runState
	prior []agent.Entry // the entries so far: those resumed from, then those recorded
	next  int
}

// Replay returns every entry so far, so that a loop started again in this process (see
// runLoop) resumes where the last one stopped.
func (j *runJournal) Replay() []agent.Entry { return slices.Clone(j.prior) }

func (j *runJournal) Record(ctx context.Context, e agent.Entry) error {
	e.Seq = j.next
	b, err := agent.MarshalEntry(e)
	if err != nil {
		return status.Errorf(codes.Internal, "checkpoint: %v", err)
	}
	c := store.Checkpoint{Step: e.Seq, Tokens: e.Tokens}
	if e.Kind == agent.EntryModel {
		c.ModelOutput = b
	} else {
		c.ToolResults = b
	}
	err = retryStore(ctx, func(ctx context.Context) error {
		return j.s.cfg.Store.PutCheckpoint(ctx, j.rs.leaseNow(), c)
	})
	switch {
	case err == nil:
		j.next++
		j.prior = append(j.prior, e)
		return nil
	case errors.Is(err, store.ErrStaleEpoch), errors.Is(err, store.ErrRunFinished):
		j.rs.lose()
		return status.Errorf(codes.Aborted, "run %s: %v", j.rs.id, errLeaseLost)
	default:
		return runStoreErr(ctx, j.s.cfg.Log, "checkpoint", err)
	}
}

// Parking on an open breaker. A durable run whose step was refused by an open breaker
// (its dependency is fenced off: say a toolrunner restarting) does not fail while it has
// time: it waits the breaker's RetryInfo, then the loop starts again from the run's
// journal, so nothing completed is repeated. Only a refusal qualifies: the refused call
// was never sent, and a step is resumed only if every tool of it is safe to run again
// (no side-effect tool without an idempotency key: a sibling cancelled mid-call may
// have had its effect). Any other failure, retried to exhaustion by the call's own retry
// layer, fails the run as before: one retrying layer, no amplification.
const (
	stepRetries      = 8
	stepRetryBackoff = 250 * time.Millisecond
	stepRetryMax     = 5 * time.Second
)

// runLoop runs the agent loop and, with a journal, runs it again after a breaker
// refusal, up to stepRetries times, while the run has time left for the wait.
func (s *Server) runLoop(rctx context.Context, rs *runState, loop *agent.Loop, model, task string, j agent.Journal) (string, error) {
	wait := stepRetryBackoff
	for attempt := 1; ; attempt++ {
		answer, err := loop.RunJournaled(rctx, RootNode, model, task, j)
		if err == nil || j == nil || rs.moved() || rctx.Err() != nil || attempt > stepRetries {
			return answer, err
		}
		oe, refused := breaker.Open(err)
		if !refused || !safeToResume(j.Replay()) {
			return answer, err
		}
		d := max(wait, oe.RetryAfter)
		d += time.Duration(rand.Int64N(int64(d)/5 + 1)) //nolint:gosec // jitter that spreads the runs one breaker refused together
		if time.Until(rs.dl) < d+s.cfg.MinRunTime {
			return answer, err
		}
		s.cfg.Log.WarnContext(rctx, "a step was refused by an open breaker; the run resumes from its journal after the breaker's delay",
			"run_id", rs.id, "attempt", attempt, "target", oe.Target, "backoff_ms", d.Milliseconds())
		t := time.NewTimer(d)
		select {
		case <-rctx.Done():
			t.Stop()
			return answer, err
		case <-t.C:
		}
		wait = min(2*wait, stepRetryMax)
	}
}

// safeToResume reports whether the step the journal stopped in may run again: its
// tool calls (if its model output was recorded) have no side effect without a key.
func safeToResume(entries []agent.Entry) bool {
	if len(entries) == 0 {
		return true
	}
	last := entries[len(entries)-1]
	if last.Kind != agent.EntryModel {
		return true // the failure was in a model step: nothing of it was done
	}
	for _, c := range last.ToolCalls {
		if catalog.NeedsKey(c.GetName()) && c.GetIdempotencyKey() == "" {
			return false
		}
	}
	return true
}

// retryStore runs fn a few times on a context that outlives the run's cancellation by
// at most storeTimeout, backing off between tries; fencing errors are not retried.
func retryStore(ctx context.Context, fn func(context.Context) error) error {
	sctx, stop := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
	defer stop()
	backoff := 50 * time.Millisecond
	var err error
	for i := 0; i < storeAttempts; i++ {
		if err = fn(sctx); err == nil || fenced(err) || sctx.Err() != nil {
			return err
		}
		t := time.NewTimer(backoff)
		select {
		case <-sctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		backoff *= 4
	}
	return err
}

func fenced(err error) bool {
	return errors.Is(err, store.ErrStaleEpoch) || errors.Is(err, store.ErrRunFinished) ||
		errors.Is(err, store.ErrNotFound) || errors.Is(err, store.ErrInvalidArgument) || errors.Is(err, store.ErrConflict)
}

// commit stores the run's result under its lease, then records a failure as a dead
// letter. It reports false when the run is no longer this process's to end.
func (s *Server) commit(ctx context.Context, rs *runState) bool {
	r := rs.snapshot()
	summary, err := proto.Marshal(r)
	if err != nil {
		s.cfg.Log.ErrorContext(ctx, "encode run summary", "run_id", rs.id, "error", err.Error())
	}
	res := store.RunResult{Status: storeStatusOf(r.GetStatus()), Cause: cancel.Name(r.GetCause()),
		Error: r.GetErrorMessage(), Answer: []byte(r.GetAnswer()), Summary: summary}
	err = retryStore(ctx, func(ctx context.Context) error {
		_, err := s.cfg.Store.FinishRun(ctx, rs.leaseNow(), res)
		return err
	})
	switch {
	case err == nil:
	case errors.Is(err, store.ErrStaleEpoch), errors.Is(err, store.ErrRunFinished):
		s.cfg.Log.WarnContext(ctx, "run was claimed by another orchestrator before its result was stored; that one's result stands",
			"run_id", rs.id, "error", err.Error())
		rs.mu.Lock()
		rs.lost = true
		rs.mu.Unlock()
		return false
	default:
		// The result is lost with this process only if it dies too: the lease lapses and
		// another orchestrator resumes the run from its last checkpoint.
		s.cfg.Log.ErrorContext(ctx, "could not store the run's result", "run_id", rs.id, "error", err.Error())
	}
	if r.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_FAILED {
		s.deadLetter(ctx, r, "")
	}
	return true
}

// abandon ends this process's part in a run that moved to another orchestrator: the
// root node ends here, the lease is released if this process handed the run over, and
// the run leaves the memory of this process, so that reads go to the store.
func (s *Server) abandon(ctx context.Context, rs *runState) {
	s.nodes.End(rs.id, RootNode, meshv1.NodeStatus_NODE_STATUS_CANCELLED, meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED,
		"UNAVAILABLE", "run moved to another orchestrator", nil)
	rs.cancel(nil)
	rs.mu.Lock()
	handover, l := rs.handover && !rs.lost, rs.lease
	rs.mu.Unlock()
	if handover {
		err := retryStore(ctx, func(ctx context.Context) error { return s.cfg.Store.ReleaseRun(ctx, l) })
		if err != nil && !fenced(err) {
			s.cfg.Log.WarnContext(ctx, "release run lease; it will be taken over when it expires", "run_id", rs.id, "error", err.Error())
		}
	}
	rs.span.End()
	rs.ticket.Release(admission.Outcome{Ended: admission.EndUnknown})
	s.forget(rs)
	close(rs.done)
	if !handover {
		s.leaseMetrics.leaseLost()
	}
	s.cfg.Log.InfoContext(ctx, "run handed to another orchestrator", "run_id", rs.id, "handover", handover)
}

// forget drops a run from this process's memory, unless another state of the same run
// (resumed here after it moved) has replaced it.
func (s *Server) forget(rs *runState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.runs[rs.id] != rs {
		return
	}
	delete(s.runs, rs.id)
	if i, ok := slices.BinarySearch(s.order, rs.id); ok {
		s.order = slices.Delete(s.order, i, i+1)
	}
}

// deadLetter records a run that failed for good. errType overrides the error class.
func (s *Server) deadLetter(ctx context.Context, r *orchestratorv1.Run, errType string) {
	if s.cfg.DeadLetters == nil {
		return
	}
	step, attempts := failingStep(r)
	if errType == "" {
		errType = strings.ToLower(r.GetErrorCode())
	}
	payload, _ := json.Marshal(ReplayPayload{Task: r.GetTask(), Model: r.GetModel()})
	dctx, stop := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
	defer stop()
	d, added, err := s.cfg.DeadLetters.Record(dctx, store.DeadLetter{Tenant: r.GetTenant(), RunID: r.GetRunId(), Step: step,
		ErrorType: errType, Attempts: attempts, LastError: r.GetErrorMessage(), Payload: payload, IdempotencyKey: r.GetIdempotencyKey()})
	if err != nil {
		s.cfg.Log.ErrorContext(ctx, "record dead letter", "run_id", r.GetRunId(), "error", err.Error(), "stored", d.ID != "")
		return
	}
	if added {
		s.cfg.Log.WarnContext(ctx, "run failed for good: dead letter recorded", "run_id", r.GetRunId(), "dead_letter", d.ID,
			"step", step, "error_type", errType, "attempts", attempts)
	}
}

// ReplayPayload is a run's dead-letter payload: what replaying it starts again.
type ReplayPayload struct {
	Task  string `json:"task"`
	Model string `json:"model,omitempty"`
}

// failingStep names the deepest failed node that carries the run's error, and its
// attempts; "root" and 1 when no node does.
func failingStep(r *orchestratorv1.Run) (string, int) {
	step, attempts, depth := RootNode, 1, -1
	for _, n := range r.GetNodes() {
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || n.GetErrorCode() != r.GetErrorCode() {
			continue
		}
		if d := strings.Count(n.GetId(), "/"); d > depth {
			step, depth = n.GetId(), d
			attempts = max(int(n.GetAttempt()), 1+len(n.GetEarlierAttempts()), 1)
		}
	}
	return step, attempts
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
	r, created, err := s.startDetached(ctx, md.IdentityFrom(ctx).Tenant, key, req.GetModel(), req.GetTask(), timeout)
	if err != nil {
		return nil, err
	}
	return &orchestratorv1.StartRunResponse{Run: r, Created: created}, nil
}

// maxKeyLen bounds an idempotency key.
const maxKeyLen = 256

// startDetached starts a run that no call follows, with the deadline timeout from now
// (capped at MaxRunTime), or the call's own deadline when timeout is 0.
func (s *Server) startDetached(ctx context.Context, tenant, key, model, task string, timeout time.Duration) (*orchestratorv1.Run, bool, error) {
	model, err := s.validate(task, model)
	if err != nil {
		return nil, false, err
	}
	if s.draining.Load() {
		// No new run; a key that already names one of this process's runs still gets it.
		if r, err := s.existingRun(tenant, key, model, task); r != nil || err != nil {
			return r, false, err
		}
		return nil, false, errDraining()
	}
	dl, _ := ctx.Deadline() // the server chain always sets one
	if timeout > 0 {
		dl = time.Now().Add(min(timeout, s.cfg.MaxRunTime))
	}
	if left := time.Until(dl); left < s.cfg.MinRunTime {
		return nil, false, status.Errorf(codes.DeadlineExceeded, "no time left to start run: %v left, needs %v", left.Round(time.Millisecond), s.cfg.MinRunTime)
	}
	// Admission waits on the run's own deadline, not the StartRun call's, and stops
	// waiting when the caller leaves.
	actx, stop := context.WithDeadline(context.WithoutCancel(ctx), dl)
	defer stop()
	defer context.AfterFunc(ctx, stop)()
	tk, err := s.admit(actx, model, task)
	if err != nil {
		return nil, false, err
	}
	rs, existing, err := s.create(ctx, tenant, key, model, task, dl)
	if err != nil || rs == nil {
		tk.Release(admission.Outcome{Ended: admission.EndFailed})
		return existing, false, err
	}
	rs.ticket = tk
	s.launch(ctx, rs, nil, false)
	return rs.snapshot(), true, nil
}

// Replay starts a dead letter's payload as a new detached run, idempotently on key: the
// Replayer of the DeadLetterService.
func (s *Server) Replay(ctx context.Context, key string, payload []byte, timeout time.Duration) (string, bool, error) {
	var p ReplayPayload
	if err := json.Unmarshal(payload, &p); err != nil || p.Task == "" {
		return "", false, status.Error(codes.FailedPrecondition, "the dead letter's payload is not a run this service can replay")
	}
	if timeout == 0 {
		timeout = s.cfg.MaxRunTime
		if dl, ok := ctx.Deadline(); ok {
			// The service default, as a run started without a timeout would get it.
			timeout = min(timeout, max(time.Until(dl), s.cfg.MinRunTime))
		}
	}
	r, created, err := s.startDetached(ctx, md.IdentityFrom(ctx).Tenant, key, p.Model, p.Task, timeout)
	if err != nil {
		return "", false, err
	}
	return r.GetRunId(), created, nil
}

// WatchRun implements OrchestratorService.WatchRun.
func (s *Server) WatchRun(req *orchestratorv1.WatchRunRequest, stream orchestratorv1.OrchestratorService_WatchRunServer) error {
	ctx := stream.Context()
	if req.GetRunId() == "" {
		return status.Error(codes.InvalidArgument, "run_id is required")
	}
	started := false
	sendStarted := func(r *orchestratorv1.Run) error {
		if started {
			return nil
		}
		started = true
		return stream.Send(&orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_Started{Started: &orchestratorv1.RunStarted{
			RunId: r.GetRunId(), Deadline: r.GetDeadline()}}})
	}
	finished := func(r *orchestratorv1.Run) error {
		if err := sendStarted(r); err != nil {
			return err
		}
		return stream.Send(&orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_Finished{Finished: r}})
	}
	for {
		if rs, err := s.visible(ctx, req.GetRunId()); err == nil {
			sub := rs.subscribe()
			err := s.follow(ctx, rs, sub, sendStarted, stream)
			rs.unsubscribe(sub)
			if err != nil {
				return err
			}
			if !rs.moved() {
				return finished(rs.snapshot())
			}
		} else if s.cfg.Store == nil {
			return err
		}
		r, err := s.stored(ctx, req.GetRunId())
		if err != nil {
			return err
		}
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return finished(r)
		}
		if err := sendStarted(r); err != nil {
			return err
		}
		t := time.NewTimer(watchPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return status.FromContextError(ctx.Err()).Err()
		case <-s.handoff:
			// Stopping: the watch of a run that goes on elsewhere must not hold the stop.
			t.Stop()
			return drainingStatus(fmt.Sprintf("orchestrator is stopping; watch run %s on another replica", req.GetRunId()))
		case <-t.C:
		}
	}
}

// follow streams a local run's events until it ends here.
func (s *Server) follow(ctx context.Context, rs *runState, sub chan *orchestratorv1.RunResponse,
	sendStarted func(*orchestratorv1.Run) error, stream orchestratorv1.OrchestratorService_WatchRunServer,
) error {
	if err := sendStarted(rs.snapshot()); err != nil {
		return err
	}
	send := func(ev *orchestratorv1.RunResponse) error {
		if n := ev.GetNode(); n != nil {
			return stream.Send(&orchestratorv1.WatchRunResponse{Event: &orchestratorv1.WatchRunResponse_Node{Node: n}})
		}
		return nil
	}
	for {
		select {
		case ev := <-sub:
			if err := send(ev); err != nil {
				return err
			}
		case <-rs.done:
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

// stored reads the caller's tenant's run from the store. A live run's nodes are read
// from the executors.
func (s *Server) stored(ctx context.Context, id string) (*orchestratorv1.Run, error) {
	run, err := s.cfg.Store.GetRun(ctx, md.IdentityFrom(ctx).Tenant, id)
	if err != nil {
		return nil, runStoreErr(ctx, s.cfg.Log, "get run", err)
	}
	r := s.fromStore(ctx, run)
	if !run.Status.Terminal() {
		setNodes(r, s.collect(ctx, id, time.Time{}, 0))
	}
	return r, nil
}

func (s *Server) listStored(ctx context.Context, size int, after string) (*orchestratorv1.ListRunsResponse, error) {
	runs, next, err := s.cfg.Store.ListRuns(ctx, store.RunQuery{Tenant: md.IdentityFrom(ctx).Tenant, After: after, Limit: size})
	if err != nil {
		return nil, runStoreErr(ctx, s.cfg.Log, "list runs", err)
	}
	resp := &orchestratorv1.ListRunsResponse{NextPageToken: next}
	for _, run := range runs {
		r := s.fromStore(ctx, run)
		r.Nodes = nil
		resp.Runs = append(resp.Runs, r)
	}
	return resp, nil
}

// fromStore turns a stored run into the API's: its stored summary when it ended here or
// elsewhere, else what the row holds.
func (s *Server) fromStore(ctx context.Context, run store.Run) *orchestratorv1.Run {
	if len(run.Summary) > 0 {
		r := &orchestratorv1.Run{}
		if err := proto.Unmarshal(run.Summary, r); err == nil {
			r.Epoch = run.Epoch
			return r
		}
		s.cfg.Log.WarnContext(ctx, "stored run summary does not decode; serving the row", "run_id", run.RunID)
	}
	r := &orchestratorv1.Run{RunId: run.RunID, Tenant: run.Tenant, Status: apiStatusOf(run.Status),
		Deadline: timestamppb.New(run.Deadline), CreatedAt: timestamppb.New(run.CreatedAt), Answer: string(run.Answer),
		ErrorMessage: run.Error, Model: run.Model, Task: string(run.Task), IdempotencyKey: run.IdempotencyKey, Epoch: run.Epoch}
	if !run.EndedAt.IsZero() {
		r.EndedAt = timestamppb.New(run.EndedAt)
	}
	r.Cause = cancel.Parse(run.Cause)
	return r
}

func storeStatusOf(st orchestratorv1.RunStatus) store.RunStatus {
	switch st {
	case orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED:
		return store.StatusSucceeded
	case orchestratorv1.RunStatus_RUN_STATUS_CANCELLED:
		return store.StatusCancelled
	case orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED:
		return store.StatusDeadlineExceeded
	}
	return store.StatusFailed
}

func apiStatusOf(st store.RunStatus) orchestratorv1.RunStatus {
	switch st {
	case store.StatusPending, store.StatusRunning:
		return orchestratorv1.RunStatus_RUN_STATUS_RUNNING
	case store.StatusSucceeded:
		return orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED
	case store.StatusCancelled:
		return orchestratorv1.RunStatus_RUN_STATUS_CANCELLED
	case store.StatusDeadlineExceeded:
		return orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED
	}
	return orchestratorv1.RunStatus_RUN_STATUS_FAILED
}

// runStoreErr maps a store error of a run operation to the caller's status, with
// storeError's classification (store.Code); an unclassified failure is logged, and the
// caller gets UNAVAILABLE without the store's text.
func runStoreErr(ctx context.Context, log *slog.Logger, op string, err error) error {
	if store.Code(err) == codes.Internal {
		log.ErrorContext(ctx, "store call failed", "op", op, "error", err.Error())
	}
	return storeError(err, "run", op+": the run store is unavailable")
}
