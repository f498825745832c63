package orchestrator

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
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
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Leases and takeover. A run is a row of the store that one orchestrator at a time owns
// through a lease (owner, epoch, expiry; see store.Runs). On a shared store:
//   - the owner heartbeats every LeaseTTL/3 and checkpoints every agent step under its
//     lease, so a write from an owner that lost the run is refused (the epoch fences it);
//   - every orchestrator scans for runs whose lease expired (their owner died) and claims
//     them with a higher epoch, then resumes each from its journal: completed model steps
//     are not generated again, completed tools are not called again (and a tool cut off
//     mid-call is made safe to repeat by toolrunner's idempotency records);
//   - a run whose deadline passed while nobody owned it ends DEADLINE_EXCEEDED and
//     becomes a dead letter.
//
// On a process-private store no one else can claim a run: its lease is never renewed
// or contested, so there are no lease loops, and the run is only created and finished
// under it.

// Bounds of the lease loops.
const (
	// maxTakeoverScan bounds the interval between two scans for expired leases: a dead
	// owner's run is taken over within LeaseTTL plus this, plus the claim.
	maxTakeoverScan = 500 * time.Millisecond
	// takeoverBatch is the most runs one scan claims.
	takeoverBatch = 16
	// heartbeatParallel is how many heartbeats one round sends at once.
	heartbeatParallel = 8
	// storeTimeout bounds the store calls made on a run's behalf after its context ended
	// (withStoreRetry), and a dead letter's record.
	storeTimeout = 5 * time.Second
)

// storeRetry is how a store write made on a run's behalf is retried (withStoreRetry): the
// store being briefly unreachable must not lose a run.
var storeRetry = retry.Policy{MaxAttempts: 3, Base: 100 * time.Millisecond, Cap: 200 * time.Millisecond}

// Start begins the lease loops on a shared store: heartbeats for the runs this process
// owns, the takeover of runs whose owner died, and the list of peers (peers.go).
// Shutdown stops them.
func (s *Server) Start(ctx context.Context) {
	if !s.shared {
		return
	}
	hctx, stopH := context.WithCancel(ctx)
	tctx, stopT := context.WithCancel(ctx)
	s.mu.Lock()
	s.stopHeartbeat, s.stopTakeover = stopH, stopT
	s.mu.Unlock()
	s.bg.Add(3)
	go func() { defer s.bg.Done(); s.heartbeats(hctx) }()
	go func() { defer s.bg.Done(); s.takeovers(tctx) }()
	go func() { defer s.bg.Done(); s.refreshPeers(tctx) }()
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

// heartbeats extends the leases of the runs this process owns every LeaseTTL/3, and
// stores the results of runs that ended while the store was down.
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
		for _, rn := range append(s.live(), s.unstored()...) {
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer func() { <-sem; wg.Done() }()
				s.heartbeat(ctx, rn)
			}()
		}
		wg.Wait()
	}
}

// heartbeat extends the run's lease; a lease found lost stops the run here. A run that
// ended while the store was down has its result stored instead.
func (s *Server) heartbeat(ctx context.Context, rn *run) {
	rn.mu.Lock()
	l, skip, unstored := rn.lease, rn.finishing || rn.lost || rn.handover, rn.unstored && !rn.lost
	rn.mu.Unlock()
	if unstored {
		if s.commit(ctx, rn) && !rn.resultUnstored() {
			s.cfg.Log.InfoContext(ctx, "stored the result of a run that ended while the store was down", "run_id", rn.id)
		}
		return
	}
	if skip || l.Epoch == 0 {
		return
	}
	nl, err := s.cfg.Store.HeartbeatRun(ctx, l, s.cfg.LeaseTTL)
	switch {
	case err == nil:
		rn.mu.Lock()
		if rn.lease.Epoch == nl.Epoch {
			rn.lease = nl
		}
		rn.mu.Unlock()
	case errors.Is(err, store.ErrStaleEpoch), errors.Is(err, store.ErrRunFinished), errors.Is(err, store.ErrNotFound):
		rn.mu.Lock()
		current := rn.lease.Epoch == l.Epoch // not reclaimed by this process meanwhile
		rn.mu.Unlock()
		if current {
			s.cfg.Log.WarnContext(ctx, "run lease lost; this orchestrator stops advancing the run", "run_id", rn.id, "epoch", l.Epoch, "error", err.Error())
			rn.lose()
		}
	case ctx.Err() != nil:
	default:
		s.cfg.Log.WarnContext(ctx, "run heartbeat failed; retrying", "run_id", rn.id, "error", err.Error())
	}
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
	if s.claimedWhileStarting(r.RunID, r.Lease()) {
		// A run this process is starting, whose lease lapsed while the store was slow
		// to record it: its start launches it, under this new lease.
		log.WarnContext(ctx, "run's lease lapsed while it was being started; its start goes on under the new lease")
		return
	}
	if rn, err := s.get(r.RunID); err == nil && !rn.moved() {
		// This process's own run, whose lease lapsed before a heartbeat (a stalled
		// store, say): the claim made this process its owner again, under a new epoch.
		// The run goes on, writing under the new lease.
		rn.mu.Lock()
		rn.lease = r.Lease()
		unstored := rn.unstored
		rn.mu.Unlock()
		if unstored {
			// It ended here while the store was down, and its client saw the end: store
			// the result now, under the new lease; never run it again.
			if s.commit(ctx, rn) && !rn.resultUnstored() {
				log.InfoContext(ctx, "stored the result of a run that ended while the store was down")
			}
			return
		}
		log.WarnContext(ctx, "run's lease lapsed before its heartbeat; reclaimed it")
		return
	}
	if s.draining.Load() {
		// A scan that raced the drain: give the run straight back for another
		// orchestrator to take.
		err := withStoreRetry(ctx, func(ctx context.Context) error { return s.cfg.Store.ReleaseRun(ctx, r.Lease()) })
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
		rn := newRun(r)
		rec := rn.rec
		rec.Status, rec.Cause = orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED, meshv1.CancelCause_CANCEL_CAUSE_DEADLINE
		rec.ErrorCode, rec.ErrorMessage = "DEADLINE_EXCEEDED", "the run's deadline passed while no orchestrator owned it"
		rec.EndedAt, rec.CancelledAt = timestamppb.Now(), timestamppb.New(r.Deadline)
		if s.commit(ctx, rn) {
			s.leaseMetrics.takeover(takeoverDeadline)
			s.deadLetter(ctx, rn.snapshot(s.shared), "deadline_exceeded")
		}
		return
	}
	prior, err := s.journalOf(ctx, r)
	if err != nil {
		// Not resumable here; leave the lease to expire and say so: another orchestrator
		// (or this one, later) tries again.
		log.ErrorContext(ctx, "cannot read the run's checkpoints; not resuming it", "error", err.Error())
		return
	}
	log.InfoContext(ctx, "resuming run", "checkpoints", len(prior), "time_left_ms", time.Until(r.Deadline).Milliseconds())
	s.leaseMetrics.takeover(takeoverResumed)
	s.launch(md.WithIdentity(ctx, md.Identity{Tenant: r.Tenant}), newRun(r), prior, detailNone)
}

// journalOf reads the journal of a run an earlier owner advanced: its checkpoints.
func (s *Server) journalOf(ctx context.Context, r store.Run) ([]agent.Entry, error) {
	cps, err := s.cfg.Store.ListCheckpoints(ctx, r.Tenant, r.RunID)
	if err != nil {
		return nil, err
	}
	var prior []agent.Entry
	for _, c := range cps {
		b := c.ModelOutput
		if len(b) == 0 {
			b = c.ToolResults
		}
		e, err := agent.UnmarshalEntry(b)
		if err != nil {
			return nil, err
		}
		e.Seq, e.Tokens = c.Step, c.Tokens
		if e.Seq != len(prior) {
			return nil, errors.New("checkpoints are not contiguous")
		}
		prior = append(prior, e)
	}
	return prior, nil
}

// runJournal is a run's agent journal in the store: each entry is a checkpoint, written
// under the run's lease.
type runJournal struct {
	s     *Server
	rn    *run
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
	// An unavailable store is waited for, within the run's deadline (storewait.go).
	err = j.s.waitForStore(ctx, j.rn, "checkpoint", func(ctx context.Context, l store.Lease) error {
		return j.s.cfg.Store.PutCheckpoint(ctx, l, c)
	})
	switch {
	case err == nil:
		j.next++
		j.prior = append(j.prior, e)
		return nil
	case errors.Is(err, store.ErrStaleEpoch), errors.Is(err, store.ErrRunFinished):
		j.rn.lose()
		return status.Errorf(codes.Aborted, "run %s: %v", j.rn.id, errLeaseLost)
	case ctx.Err() != nil:
		// The deadline or a cancel ended the run while it waited: the run ends as its
		// context says (execute), not for the store.
		return status.FromContextError(ctx.Err()).Err()
	default:
		return runStoreErr(ctx, j.s.cfg.Log, "checkpoint", j.rn.id, err)
	}
}

// withStoreRetry runs fn under storeRetry on a context that outlives the run's
// cancellation by at most storeTimeout; fencing errors are not retried.
func withStoreRetry(ctx context.Context, fn func(context.Context) error) error {
	sctx, stop := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
	defer stop()
	var err error
	for n := 1; n <= storeRetry.MaxAttempts; n++ {
		if n > 1 {
			t := time.NewTimer(storeRetry.Backoff(n, rand.Float64))
			select {
			case <-sctx.Done():
				t.Stop()
				return err
			case <-t.C:
			}
		}
		if err = fn(sctx); err == nil || fenced(err) || sctx.Err() != nil {
			return err
		}
	}
	return err
}

func fenced(err error) bool {
	return errors.Is(err, store.ErrStaleEpoch) || errors.Is(err, store.ErrRunFinished) ||
		errors.Is(err, store.ErrNotFound) || errors.Is(err, store.ErrInvalidArgument) || errors.Is(err, store.ErrConflict)
}

// commit stores the run's result under its lease, then records a failure as a dead
// letter. It reports false when the run is no longer this process's to end. A result
// the store cannot take now is kept (run.unstored) and stored again by the heartbeats.
func (s *Server) commit(ctx context.Context, rn *run) bool {
	r := rn.snapshot(s.shared)
	summary, err := proto.Marshal(r)
	if err != nil {
		s.cfg.Log.ErrorContext(ctx, "encode run summary", "run_id", rn.id, "error", err.Error())
	}
	res := store.RunResult{Status: storeStatusOf(r.GetStatus()), Cause: cancel.Name(r.GetCause()),
		Error: r.GetErrorMessage(), Answer: []byte(r.GetAnswer()), Summary: summary}
	err = withStoreRetry(ctx, func(ctx context.Context) error {
		_, err := s.cfg.Store.FinishRun(ctx, rn.leaseNow(), res)
		return err
	})
	rn.mu.Lock()
	rn.unstored = err != nil && !fenced(err)
	rn.mu.Unlock()
	switch {
	case err == nil:
	case errors.Is(err, store.ErrStaleEpoch), errors.Is(err, store.ErrRunFinished):
		s.cfg.Log.WarnContext(ctx, "run was claimed by another orchestrator before its result was stored; that one's result stands",
			"run_id", rn.id, "error", err.Error())
		rn.mu.Lock()
		rn.lost = true
		rn.mu.Unlock()
		return false
	default:
		// Kept in memory: once the lease lapses, the scan reclaims the run and stores its
		// result then (resume). The result is lost only if this process dies too: then
		// another orchestrator resumes the run from its last checkpoint.
		s.cfg.Log.ErrorContext(ctx, "could not store the run's result; storing it again once the store answers", "run_id", rn.id, "error", err.Error())
	}
	if r.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_FAILED && err == nil {
		s.deadLetter(ctx, r, "") // once, with the result stored (a result stored later records it then)
	}
	return true
}

// abandon ends this process's part in a run that moved to another orchestrator: the
// root node ends here, the lease is released if this process handed the run over, and
// the run leaves the memory of this process, so that reads go to the store.
func (s *Server) abandon(ctx context.Context, rn *run) {
	s.nodes.End(rn.id, RootNode, meshv1.NodeStatus_NODE_STATUS_CANCELLED, meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED,
		"UNAVAILABLE", "run moved to another orchestrator", nil)
	rn.cancel(nil)
	rn.mu.Lock()
	handover, l := rn.handover && !rn.lost, rn.lease
	rn.mu.Unlock()
	if handover {
		err := withStoreRetry(ctx, func(ctx context.Context) error { return s.cfg.Store.ReleaseRun(ctx, l) })
		if err != nil && !fenced(err) {
			s.cfg.Log.WarnContext(ctx, "release run lease; it will be taken over when it expires", "run_id", rn.id, "error", err.Error())
		}
	}
	rn.span.End()
	rn.ticket.Release(admission.Outcome{Ended: admission.EndUnknown}) //nolint:contextcheck // a ticket's release has no caller context
	s.forget(rn)
	close(rn.done)
	if !handover {
		s.leaseMetrics.leaseLost()
	}
	s.cfg.Log.InfoContext(ctx, "run handed to another orchestrator", "run_id", rn.id, "handover", handover)
}
