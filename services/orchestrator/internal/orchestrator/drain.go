package orchestrator

import (
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/cancel"
)

// The drain (docs/leases.md#drain). A stopping orchestrator has one deadline, by: the service
// runtime's StopDeadline (SIGTERM + --drain-delay + --shutdown-grace).
//
//   - Drain, when the stop begins: no new run is admitted (Run, StartRun and dead-letter
//     replays are refused UNAVAILABLE with ErrorInfo DRAINING; a StartRun whose
//     idempotency key names a run of this process still gets it), queued admissions are
//     shed, and no more runs are taken over. Runs in flight, attached or detached, go on;
//     their leases are still heartbeaten. Reads (GetRun, ListRuns, WatchRun, dead
//     letters) keep working.
//   - At the handover point, by minus a margin (handoverMargin), every run still here is
//     handed over: it stops advancing and its lease is released, so that another
//     orchestrator on the store resumes it from its last checkpoint within one scan (on
//     a process-private store, which no other orchestrator reads, it is cancelled with
//     cause operator). Attached Run streams of those runs end UNAVAILABLE ("moved to another orchestrator; follow it with WatchRun"), and
//     WatchRun streams still polling a run end UNAVAILABLE with DRAINING, so that no
//     stream holds the server's graceful stop.
//   - Shutdown, after the server stopped, waits for the runs' teardown until by and stops
//     the lease loops.

// DrainingReason is the ErrorInfo reason (domain curfew.dev) of a call refused because
// the orchestrator is draining.
const DrainingReason = "DRAINING"

// Bounds of the handover margin: the time between the handover point and the stop
// deadline, for the runs' teardown and lease releases. It is a fifth of the drain's
// whole window, within these bounds (never more than the window itself).
const (
	minHandoverMargin = 100 * time.Millisecond
	maxHandoverMargin = 2 * time.Second
)

// handoverPoint is when the runs still in flight are handed over, for a drain from now
// to by.
func handoverPoint(now, by time.Time) time.Time {
	window := by.Sub(now)
	if window <= 0 {
		return now
	}
	margin := min(max(window/5, minHandoverMargin), maxHandoverMargin, window)
	return by.Add(-margin)
}

// drainingStatus is UNAVAILABLE with msg and ErrorInfo DRAINING: retry elsewhere.
func drainingStatus(msg string) error {
	st := status.New(codes.Unavailable, msg)
	if d, err := st.WithDetails(&errdetails.ErrorInfo{Reason: DrainingReason, Domain: admission.Domain,
		Metadata: map[string]string{"service": "orchestrator"}}); err == nil {
		st = d
	}
	return st.Err()
}

// errDraining refuses a new run during the drain.
func errDraining() error {
	return drainingStatus("orchestrator is draining; retry on another replica")
}

// Draining reports whether the drain has begun.
func (s *Server) Draining() bool { return s.draining.Load() }

// Drain begins the stop (see above): no new runs, no more takeovers, and the runs still
// here at the handover point before by are handed over. Only the first call counts. It
// does not block.
func (s *Server) Drain(by time.Time) {
	s.drainOnce.Do(func() {
		now := time.Now()
		s.draining.Store(true)
		s.stopTakeovers()
		if s.cfg.Admission != nil {
			s.cfg.Admission.Close() // sheds what is queued
		}
		s.drainBy, s.handoverAt = by, handoverPoint(now, by)
		s.cfg.Log.Info("draining: new runs are refused; runs in flight go on until the handover point",
			"runs", len(s.live()), "handover_in_ms", s.handoverAt.Sub(now).Milliseconds(), "stop_in_ms", by.Sub(now).Milliseconds())
		s.bg.Add(1)
		go func() {
			defer s.bg.Done()
			t := time.NewTimer(time.Until(s.handoverAt))
			defer t.Stop()
			select {
			case <-t.C:
				s.handOverAll()
			case <-s.handedOver: // Shutdown came first
			}
		}()
	})
}

// handOverAll hands over every run still in flight, once, and closes handedOver. On
// a process-private store no other orchestrator could resume a run, so the runs are
// cancelled instead (cause operator).
func (s *Server) handOverAll() {
	s.handoverOnce.Do(func() {
		handed, ending := 0, 0
		s.mu.Lock()
		for _, rn := range s.runs {
			switch {
			case rn.ended():
				continue
			case !s.shared:
				rn.cancelTree(cancel.ErrOperator, false) // under s.mu: no waiting per run
				handed++
			case rn.handOver():
				handed++
			default:
				ending++ // its result is being committed
			}
		}
		s.mu.Unlock()
		s.handovers = handed
		close(s.handedOver)
		switch {
		case handed == 0:
			s.cfg.Log.Info("drain: no run left to hand over", "committing", ending)
		case !s.shared:
			s.cfg.Log.Warn("drain: runs still in flight at the handover point are cancelled (the store is private to this process: no orchestrator could resume them)", "runs", handed)
		default:
			s.cfg.Log.Info("drain: handing over the runs still in flight; another orchestrator resumes them from their checkpoints",
				"runs", handed, "committing", ending)
		}
	})
}

// Shutdown ends the stop that Drain began (it drains first if Drain was not called):
// it waits for the runs in flight until the handover point, hands over the rest (on a
// private store, cancels them), waits for their teardown until by, and stops the lease
// loops.
// A by earlier than the drain's brings the handover point forward with it. A run still
// tearing down at by is left: its lease lapses and another orchestrator takes it over.
func (s *Server) Shutdown(by time.Time) {
	s.Drain(by)
	if s.drainBy.Before(by) {
		by = s.drainBy
	}
	handover := handoverPoint(time.Now(), by)
	if s.handoverAt.Before(handover) {
		handover = s.handoverAt
	}
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	t := time.NewTimer(time.Until(handover))
	select {
	case <-done:
	case <-t.C:
	case <-s.handedOver:
	}
	t.Stop()
	s.handOverAll()
	t = time.NewTimer(time.Until(by))
	select {
	case <-done:
		s.cfg.Log.Info("drain: done; every run ended here or was handed over", "handed_over", s.handovers)
	case <-t.C:
		s.cfg.Log.Warn("drain: runs still tearing down at the stop deadline; their leases lapse and another orchestrator takes them over",
			"runs", len(s.live()))
	}
	t.Stop()
	s.stopLeases()
}

// existingRun is the run of this process that key (of tenant) already started, for a
// StartRun during the drain; nil when there is none. Only the runs this process holds
// are searched: another replica finds the rest in the store.
func (s *Server) existingRun(tenant, key, model, task string, in *orchestratorv1.RunInput) (*orchestratorv1.Run, error) {
	if key == "" {
		return nil, nil
	}
	var found *run
	s.mu.Lock()
	for _, rn := range s.runs {
		if rn.rec.GetTenant() == tenant && rn.rec.GetIdempotencyKey() == key {
			found = rn
			break
		}
	}
	s.mu.Unlock()
	if found == nil {
		return nil, nil
	}
	r := found.snapshot(s.shared)
	if r.GetTask() != task || r.GetModel() != model || !sameInput(r.GetInput(), in) {
		return nil, status.Errorf(codes.AlreadyExists, "idempotency key %q already started run %s with another input (task, model or other fields)", key, r.GetRunId())
	}
	return r, nil
}
