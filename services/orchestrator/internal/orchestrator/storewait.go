package orchestrator

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"github.com/google/uuid"

	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Waiting for the store. A durable run cannot go on without its checkpoints: the next
// owner resumes from them. A checkpoint write that fails because the store is out of
// reach (store.ErrUnavailable: PostgreSQL restarting, its connections cut; or an attempt
// the store did not answer within storeTimeout) does not fail the run: the run waits for
// the store, trying the write again with backoff for as long as its own deadline and
// cancel allow, and goes on when the store is back. Nothing the run did is repeated: the
// loop is held at the write, and the write is the same checkpoint each time (the store
// takes a step written twice with the same content as one write).
//
// Only an outage is waited out. A fenced write (another orchestrator claimed the run:
// stale epoch, or it ended) stops the run here at once, as before, and any other store
// error fails it: the store answered, and waiting would not change the answer. The
// run's lease may lapse while the store is down; once it answers, either nobody
// claimed the run and the write goes through (under the new epoch if this process's own
// scan re-claimed it meanwhile), or another orchestrator did and the write, or a
// heartbeat, finds the lease lost and the run stops here without writing over the new
// owner.
//
// While it waits the run says so: one log line when the wait begins and one when it
// ends, curfew_runs_waiting_for_store while it lasts and curfew_run_store_waits_total
// for each wait (leasemetrics.go). A deadline that passes during the wait ends the run
// DEADLINE_EXCEEDED, a cancel ends it CANCELLED at once: the wait sleeps on the run's
// context.
//
// A new run's record is written this way too (createRun): a start during an outage
// waits for the store, within the call's deadline and the run's, and the run starts
// once the store is back, rather than being refused.
//
// The run's result is not written this way: a run that ended keeps a result the store
// could not take and the heartbeats store it later (commit, run.unstored).

// storeWait paces the tries of a write while the run waits for the store: full jitter
// under a ceiling of 50 ms, doubling with each try up to 1 s. There is no limit on the
// tries: the run's deadline is the limit.
var storeWait = retry.Policy{Base: 50 * time.Millisecond, Cap: time.Second}

// waitForStore runs write, a store write under rn's lease that the run's progress
// needs, and while it fails because the store is out of reach, runs it again (see
// above), each time under the lease as it is then. It returns nil, the write's error
// once it is not an outage, or the last outage error once ctx has ended (the caller
// reports ctx's end).
//
// The first try runs on a context that outlives a cancel of the run (by at most
// storeTimeout), as withStoreRetry's do, so that a step's checkpoint in flight still
// lands when the run is handed over; the tries of a wait run on the run's context, so
// that a cancel or the deadline ends the wait at once.
func (s *Server) waitForStore(ctx context.Context, rn *run, op string, write func(context.Context, store.Lease) error) error {
	return s.waitOut(ctx, rn.id, rn.dl, op, func(try int) error {
		for {
			l := rn.leaseNow()
			err := tryStore(ctx, try == 1, func(ctx context.Context) error { return write(ctx, l) })
			if errors.Is(err, store.ErrStaleEpoch) && rn.leaseNow().Epoch != l.Epoch {
				// The lease changed under the write: this process's scan re-claimed the
				// run after its lease lapsed in the wait (resume). Write again under the
				// new one.
				continue
			}
			return err
		}
	})
}

// waitOut runs attempt (its argument counts the tries from 1) until it returns nil or
// an error that is not an outage, or ctx ends; while it fails with an outage, it is run
// again after storeWait's backoff. The wait of run id (deadline dl) is logged when it
// begins and ends, with op, and counted (curfew_runs_waiting_for_store,
// curfew_run_store_waits_total). It returns attempt's last error.
func (s *Server) waitOut(ctx context.Context, id string, dl time.Time, op string, attempt func(try int) error) error {
	var began time.Time // when the wait began; zero while there is none
	stop := func(tries int, err error) error {
		if !began.IsZero() {
			s.leaseMetrics.storeWaitEnded()
			s.cfg.Log.InfoContext(ctx, "run stopped waiting for the store", "run_id", id, "op", op,
				"waited_ms", time.Since(began).Milliseconds(), "tries", tries, "stored", err == nil)
		}
		return err
	}
	for try := 1; ; try++ {
		err := attempt(try)
		if !outage(err) || ctx.Err() != nil {
			return stop(try, err)
		}
		if began.IsZero() {
			began = time.Now()
			s.leaseMetrics.storeWaitBegan()
			s.cfg.Log.WarnContext(ctx, "the store is unavailable; the run waits for it within its deadline", "run_id", id, "op", op,
				"time_left_ms", time.Until(dl).Milliseconds(), "error", err.Error())
		}
		t := time.NewTimer(storeWait.Backoff(try+1, rand.Float64))
		select {
		case <-ctx.Done():
			t.Stop()
			return stop(try, err)
		case <-t.C:
		}
	}
}

// tryStore runs one try of a store write, bounded by storeTimeout; detached, it
// outlives ctx's cancel. A try the store does not answer in time returns errNoAnswer.
func tryStore(ctx context.Context, detached bool, write func(context.Context) error) error {
	parent := ctx
	if detached {
		parent = context.WithoutCancel(ctx)
	}
	tctx, stop := context.WithTimeout(parent, storeTimeout)
	defer stop()
	err := write(tctx)
	if err != nil && errors.Is(tctx.Err(), context.DeadlineExceeded) && parent.Err() == nil {
		return errors.Join(errNoAnswer, err)
	}
	return err
}

// errNoAnswer: a try of a store write that the store did not answer within storeTimeout
// (a connection hanging rather than refused): an outage too.
var errNoAnswer = errors.New("the store did not answer within " + storeTimeout.String())

// outage reports whether err says the store is out of reach, which a run waits out.
func outage(err error) bool {
	return errors.Is(err, store.ErrUnavailable) || errors.Is(err, errNoAnswer)
}

// createRun records the new run nr, waiting out a store outage as a checkpoint does
// (above) for as long as ctx allows: the caller leaving, or its deadline, ends the wait
// with the outage's error.
//
// The run's id is chosen here, before the first try, so that a try the store committed
// without answering (its connection cut after the commit) is recognised by the next:
// the same id already taken, or the idempotency key already naming that id, is this
// very run, created, not another caller's.
//
// Until the run is added to this process's table (launch), a takeover scan here that
// claims it (its lease lapsed while the store was slow) leaves it to this start
// (Server.creating); a start that records no run of its own ends that note itself.
func (s *Server) createRun(ctx context.Context, nr store.NewRun) (r store.Run, created bool, err error) {
	nr.RunID = uuid.Must(uuid.NewV7()).String()
	done := s.creating(nr.RunID)
	defer func() {
		if err != nil || !created {
			done()
		}
	}()
	err = s.waitOut(ctx, nr.RunID, nr.Deadline, "create run", func(try int) error {
		err := tryStore(ctx, false, func(ctx context.Context) error {
			var err error
			r, created, err = s.cfg.Store.CreateRun(ctx, nr)
			return err
		})
		if try > 1 {
			r, created, err = s.ownEarlierTry(ctx, nr, r, created, err)
		}
		return err
	})
	return r, created, err
}

// ownEarlierTry judges a retried CreateRun's answer: a run this call's earlier try
// created, unacknowledged, is taken as created now.
func (s *Server) ownEarlierTry(ctx context.Context, nr store.NewRun, r store.Run, created bool, err error) (store.Run, bool, error) {
	switch {
	case err == nil && !created && r.RunID == nr.RunID: // the idempotency key names it
		return r, true, nil
	case errors.Is(err, store.ErrAlreadyExists):
		var got store.Run
		gerr := tryStore(ctx, false, func(ctx context.Context) error {
			var err error
			got, err = s.cfg.Store.GetRun(ctx, nr.Tenant, nr.RunID)
			return err
		})
		if gerr != nil {
			if outage(gerr) {
				return r, false, gerr // try again
			}
			return r, created, err
		}
		if got.Owner == nr.Owner && string(got.Task) == string(nr.Task) {
			return got, true, nil
		}
	}
	return r, created, err
}
