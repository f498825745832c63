package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// outageStore is a real store that this orchestrator cannot reach while down: its
// checkpoints, heartbeats, takeover scans and results fail with the error the PostgreSQL
// backend returns while the server restarts (the connection refused, marked
// store.ErrUnavailable).
type outageStore struct {
	store.Store
	down    atomic.Bool
	refused atomic.Int64 // checkpoint writes refused
}

var errRefused = fmt.Errorf("%w: %w", store.ErrUnavailable,
	&net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)})

func (o *outageStore) PutCheckpoint(ctx context.Context, l store.Lease, c store.Checkpoint) error {
	if o.down.Load() {
		o.refused.Add(1)
		return errRefused
	}
	return o.Store.PutCheckpoint(ctx, l, c)
}

func (o *outageStore) HeartbeatRun(ctx context.Context, l store.Lease, ttl time.Duration) (store.Lease, error) {
	if o.down.Load() {
		return store.Lease{}, errRefused
	}
	return o.Store.HeartbeatRun(ctx, l, ttl)
}

func (o *outageStore) ClaimExpiredRuns(ctx context.Context, owner string, ttl time.Duration, limit int) ([]store.Run, error) {
	if o.down.Load() {
		return nil, errRefused
	}
	return o.Store.ClaimExpiredRuns(ctx, owner, ttl, limit)
}

func (o *outageStore) FinishRun(ctx context.Context, l store.Lease, res store.RunResult) (store.Run, error) {
	if o.down.Load() {
		return store.Run{}, errRefused
	}
	return o.Store.FinishRun(ctx, l, res)
}

// waitRefused waits until the store has refused at least n checkpoint writes of run
// id, which must go on meanwhile.
func (o *outageStore) waitRefused(t *testing.T, e *env, id string, n int64) {
	t.Helper()
	for until := time.Now().Add(10 * time.Second); o.refused.Load() < n; time.Sleep(5 * time.Millisecond) {
		resp, err := e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: id})
		if r := resp.GetRun(); err != nil || r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			t.Fatalf("after %d refused checkpoint writes the run is %v %s: %s (%v), want it waiting for the store",
				o.refused.Load(), r.GetStatus(), r.GetErrorCode(), r.GetErrorMessage(), err)
		}
		if time.Now().After(until) {
			t.Fatalf("the store refused %d checkpoint writes, want %d", o.refused.Load(), n)
		}
	}
}

func newStoreWaitEnv(t *testing.T, st store.Store) (*env, *prometheus.Registry) {
	t.Helper()
	return newStoreWaitEnvOf(t, st, "orch-a", 2*time.Second)
}

func newStoreWaitEnvOf(t *testing.T, st store.Store, owner string, ttl time.Duration) (*env, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) {
		c.Store, c.Owner, c.LeaseTTL, c.DeadLetters, c.Registerer = st, owner, ttl, deadLetters{st}, reg
	})
	return e, reg
}

// A run whose checkpoints cannot be written while the store is down waits for the
// store, and carries on when it is back: it succeeds, with every model step decoded
// once and every tool called once, and said that it waited.
func TestRunWaitsForTheStore(t *testing.T) {
	st, e, id := startWhileDown(t, 30*time.Second)
	ctx := context.Background()

	// The first checkpoint (step 0's model output) is refused, tried again and again:
	// the run waits at it, its tools not called yet.
	st.waitRefused(t, e, id, 4)
	got, err := e.orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil || got.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
		t.Fatalf("while the store is down the run is %v (%v), want RUNNING", got.GetRun().GetStatus(), err)
	}
	if n := e.tools.total(); n != 0 {
		t.Fatalf("%d tool calls before the model step's checkpoint was stored", n)
	}
	if n := testutil.ToFloat64(e.srv.leaseMetrics.waiting); n != 1 {
		t.Errorf("curfew_runs_waiting_for_store = %v while the run waits, want 1", n)
	}

	st.down.Store(false)
	r := e.waitEndedWithin(t, id, 10*time.Second)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run ended %v %s: %s, want SUCCEEDED once the store is back", r.GetStatus(), r.GetErrorCode(), r.GetErrorMessage())
	}
	if got := e.decoders(); len(got) != 2 {
		t.Errorf("decoders %v, want each of the 2 model steps once", got)
	}
	for node, n := range e.tools.counts() {
		if n != 1 {
			t.Errorf("tool %s called %d times, want once", node, n)
		}
	}
	if n := e.tools.total(); n != 2 {
		t.Errorf("%d tool calls, want 2", n)
	}
	cps, err := st.ListCheckpoints(ctx, md.DefaultTenant, id)
	if err != nil || len(cps) != 3 {
		t.Errorf("checkpoints %d (%v), want 3", len(cps), err)
	}
	if n := testutil.ToFloat64(e.srv.leaseMetrics.storeWaits); n != 1 {
		t.Errorf("curfew_run_store_waits_total = %v, want 1", n)
	}
	if n := testutil.ToFloat64(e.srv.leaseMetrics.waiting); n != 0 {
		t.Errorf("curfew_runs_waiting_for_store = %v after the wait, want 0", n)
	}
}

// A store error that is not an outage is not waited out: the run fails at once.
func TestRunDoesNotWaitOnAStoreAnswer(t *testing.T) {
	st := &failCheckpoints{Store: openStore(t), err: errors.New("store: disk I/O error")}
	e, _ := newStoreWaitEnv(t, st)
	res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: fastPlan, Timeout: durationpb.New(30 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	r := e.waitEndedWithin(t, res.GetRun().GetRunId(), 5*time.Second)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED || r.GetErrorCode() != "UNAVAILABLE" {
		t.Fatalf("run ended %v %s, want FAILED UNAVAILABLE", r.GetStatus(), r.GetErrorCode())
	}
	if n := st.tries.Load(); n > int64(storeRetry.MaxAttempts) {
		t.Errorf("the checkpoint was tried %d times, want at most %d: not waited for", n, storeRetry.MaxAttempts)
	}
	if n := testutil.ToFloat64(e.srv.leaseMetrics.storeWaits); n != 0 {
		t.Errorf("curfew_run_store_waits_total = %v, want 0", n)
	}
}

// failCheckpoints is a real store whose checkpoint writes fail with err.
type failCheckpoints struct {
	store.Store
	err   error
	tries atomic.Int64
}

func (f *failCheckpoints) PutCheckpoint(context.Context, store.Lease, store.Checkpoint) error {
	f.tries.Add(1)
	return f.err
}

// A run waiting for the store ends DEADLINE_EXCEEDED at its deadline, not later and not
// for the store; the wait ends with it.
func TestStoreWaitEndsAtTheDeadline(t *testing.T) {
	const timeout = 1500 * time.Millisecond
	st, e, id := startWhileDown(t, timeout)
	st.waitRefused(t, e, id, 2)
	r := e.waitEndedWithin(t, id, 10*time.Second)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED || r.GetErrorCode() != "DEADLINE_EXCEEDED" {
		t.Fatalf("run ended %v %s: %s, want DEADLINE_EXCEEDED", r.GetStatus(), r.GetErrorCode(), r.GetErrorMessage())
	}
	dl := r.GetDeadline().AsTime()
	// Not before the deadline; after it by less than a backoff's ceiling plus a
	// scheduler's margin (the machine is shared): the wait sleeps on the run's context.
	if end := r.GetEndedAt().AsTime(); end.Before(dl) || end.Sub(dl) > storeWait.Cap+2*time.Second {
		t.Errorf("ended %v after the deadline, want within %v", end.Sub(dl), storeWait.Cap+2*time.Second)
	}
	if n := e.tools.total(); n != 0 {
		t.Errorf("%d tool calls, want none: the model step's checkpoint never landed", n)
	}
	// The end is stored once the store is back (the heartbeats store a kept result).
	st.down.Store(false)
	waitStored(t, st, id, store.StatusDeadlineExceeded)
	if n := testutil.ToFloat64(e.srv.leaseMetrics.waiting); n != 0 {
		t.Errorf("curfew_runs_waiting_for_store = %v after the run ended, want 0", n)
	}
}

// A run waiting for the store and cancelled ends CANCELLED at once, not when the store
// is back.
func TestStoreWaitEndsAtACancel(t *testing.T) {
	st, e, id := startWhileDown(t, 30*time.Second)
	ctx := context.Background()
	st.waitRefused(t, e, id, 4) // waiting (past the first try, which outlives a cancel)
	asked := time.Now()
	if _, err := e.orch.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "test"}); err != nil {
		t.Fatal(err)
	}
	r := e.waitEndedWithin(t, id, 10*time.Second)
	took := time.Since(asked)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
		t.Fatalf("run ended %v %s: %s, want CANCELLED", r.GetStatus(), r.GetErrorCode(), r.GetErrorMessage())
	}
	// Promptly: well under the 30 s deadline and the store's outage, which goes on;
	// the bound leaves room for a loaded machine, not for another backoff.
	if took > 3*time.Second {
		t.Errorf("the cancel took %v to end the waiting run", took)
	}
	if !st.down.Load() {
		t.Fatal("the store came back during the test")
	}
	st.down.Store(false)
	waitStored(t, st, id, store.StatusCancelled)
}

// A run whose lease lapses while it waits for the store, and which another
// orchestrator takes over meanwhile, stops here once the store is back: its checkpoint
// is refused as stale, and nothing of it lands over the new owner's run.
func TestStoreWaitStopsWhenAnotherOrchestratorTookTheRun(t *testing.T) {
	base := openStore(t)
	st := &outageStore{Store: base}
	st.down.Store(true)
	const ttl = 300 * time.Millisecond
	a, _ := newStoreWaitEnvOf(t, st, "orch-a", ttl)
	ctx := context.Background()
	res, err := a.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: fastPlan, Timeout: durationpb.New(30 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	id := res.GetRun().GetRunId()
	st.waitRefused(t, a, id, 2)

	// orch-b reaches the store: it claims the run once orch-a's lease lapsed, resumes
	// it (no checkpoint was written) and ends it.
	b, _ := newStoreWaitEnvOf(t, base, "orch-b", ttl)
	var ended store.Run
	for until := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		r, err := base.GetRun(ctx, md.DefaultTenant, id)
		if err == nil && r.Status.Terminal() {
			ended = r
			break
		}
		if time.Now().After(until) {
			t.Fatalf("orch-b did not end the run: %+v %v", r, err)
		}
	}
	if ended.Status != store.StatusSucceeded || ended.Owner != "orch-b" || ended.Epoch != 2 {
		t.Fatalf("stored %s by %s at epoch %d, want succeeded by orch-b at epoch 2", ended.Status, ended.Owner, ended.Epoch)
	}

	// The store is back for orch-a: its next try is refused as stale and it stops.
	st.down.Store(false)
	for until := time.Now().Add(10 * time.Second); testutil.ToFloat64(a.srv.leaseMetrics.lost) != 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(until) {
			t.Fatal("orch-a did not stop the run it lost")
		}
	}
	cps, err := base.ListCheckpoints(ctx, md.DefaultTenant, id)
	if err != nil || len(cps) != 3 {
		t.Fatalf("checkpoints %d (%v), want orch-b's 3", len(cps), err)
	}
	for _, c := range cps {
		if c.Epoch != 2 {
			t.Errorf("checkpoint %d written under epoch %d, want only orch-b's (2)", c.Step, c.Epoch)
		}
	}
	if got := a.tools.total(); got != 0 {
		t.Errorf("orch-a called %d tools for a run it lost", got)
	}
	if r, err := base.GetRun(ctx, md.DefaultTenant, id); err != nil || r.Status != store.StatusSucceeded || r.Epoch != 2 {
		t.Errorf("after orch-a stopped, the store has %s at epoch %d (%v), want orch-b's result", r.Status, r.Epoch, err)
	}
	if n := b.tools.total(); n != 2 {
		t.Errorf("orch-b called %d tools, want 2", n)
	}
}

// waitStored waits until the store holds the run ended with want.
func waitStored(t *testing.T, st store.Store, id string, want store.RunStatus) {
	t.Helper()
	for until := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		r, err := st.GetRun(context.Background(), md.DefaultTenant, id)
		if err == nil && r.Status.Terminal() {
			if r.Status != want {
				t.Fatalf("stored %s, want %s", r.Status, want)
			}
			return
		}
		if time.Now().After(until) {
			t.Fatalf("the run's end was never stored: %+v %v", r, err)
		}
	}
}

// waitEndedWithin polls GetRun until the run is no longer running, for at most d.
func (e *env) waitEndedWithin(t *testing.T, id string, d time.Duration) *orchestratorv1.Run {
	t.Helper()
	for until := time.Now().Add(d); ; time.Sleep(10 * time.Millisecond) {
		resp, err := e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: id})
		if err != nil {
			t.Fatal(err)
		}
		if r := resp.GetRun(); r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return r
		}
		if time.Now().After(until) {
			t.Fatalf("run %s still running after %v", id, d)
		}
	}
}

// counts returns the calls per run and node so far; total their sum.
func (f *fakeTools) counts() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[string]int, len(f.calls))
	for k, v := range f.calls {
		out[k] = v
	}
	return out
}

func (f *fakeTools) total() int {
	n := 0
	for _, v := range f.counts() {
		n += v
	}
	return n
}

// startWhileDown starts a run of fastPlan with timeout on an orchestrator whose store is
// down, and returns the store (to bring back), the environment and the run's id.
func startWhileDown(t *testing.T, timeout time.Duration) (*outageStore, *env, string) {
	t.Helper()
	st := &outageStore{Store: openStore(t)}
	st.down.Store(true)
	e, _ := newStoreWaitEnv(t, st)
	res, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: fastPlan, Timeout: durationpb.New(timeout)})
	if err != nil {
		t.Fatal(err)
	}
	return st, e, res.GetRun().GetRunId()
}

// createOutage is a real store whose CreateRun is refused while down, and whose next
// CreateRun after ambiguous is committed but answered as a cut connection (the commit
// landed, its acknowledgement did not).
type createOutage struct {
	store.Store
	down, ambiguous atomic.Bool
	// downAfter: the ambiguous create takes the store down for CreateRun.
	downAfter atomic.Bool
	refused   atomic.Int64
}

func (c *createOutage) CreateRun(ctx context.Context, r store.NewRun) (store.Run, bool, error) {
	if c.down.Load() {
		c.refused.Add(1)
		return store.Run{}, false, errRefused
	}
	run, created, err := c.Store.CreateRun(ctx, r)
	if err == nil && c.ambiguous.CompareAndSwap(true, false) {
		if c.downAfter.Load() {
			c.down.Store(true)
		}
		return store.Run{}, false, errRefused
	}
	return run, created, err
}

// A start whose run the store recorded without answering, and stayed out of reach for
// CreateRun longer than the run's lease, finds its run claimed by this process's own
// takeover scan (epoch 2) when the store is back. The run is launched once, by the start,
// under the scan's lease, and succeeds: each model step decoded once, each tool called
// once. A launch by the scan as well would run it twice and put its id twice in the
// table.
func TestStartAndTakeoverLaunchARunOnce(t *testing.T) {
	st := &createOutage{Store: openStore(t)}
	st.ambiguous.Store(true)
	st.downAfter.Store(true)
	e, _ := newStoreWaitEnvOf(t, st, "orch-a", 300*time.Millisecond)
	ctx := context.Background()
	done := make(chan error, 1)
	var id string
	go func() {
		res, err := e.orch.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: fastPlan, Timeout: durationpb.New(30 * time.Second)})
		id = res.GetRun().GetRunId()
		done <- err
	}()
	// The first create landed unanswered; the scan claims the run once its lease lapses.
	for until := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		runs, _, err := st.ListRuns(ctx, store.RunQuery{Tenant: md.DefaultTenant})
		if err == nil && len(runs) == 1 && runs[0].Epoch >= 2 {
			break
		}
		if time.Now().After(until) {
			t.Fatalf("the takeover scan did not claim the run being started within 10 s: %v %v", runs, err)
		}
	}
	st.down.Store(false)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("StartRun: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("StartRun still waiting 10 s after the store came back")
	}
	if r := e.waitEndedWithin(t, id, 10*time.Second); r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run ended %v %s: %s, want SUCCEEDED", r.GetStatus(), r.GetErrorCode(), r.GetErrorMessage())
	}
	if got := e.decoders(); len(got) != 2 {
		t.Errorf("decoders %v, want each of the 2 model steps once", got)
	}
	for node, n := range e.tools.counts() {
		if n != 1 {
			t.Errorf("tool %s called %d times, want once", node, n)
		}
	}
	e.srv.mu.Lock()
	order, starting := len(e.srv.order), len(e.srv.startingRuns)
	e.srv.mu.Unlock()
	if order != 1 || starting != 0 {
		t.Errorf("the table orders %d runs and %d starts are pending, want 1 and 0", order, starting)
	}
}

// A run of an id already in the table (resumed here after it moved away and back)
// replaces the old one and keeps one place in the order, so that forgetting ended runs
// beyond MaxRuns finds every id it orders: a second place would outlive the run it named,
// and every start past MaxRuns would then fail.
func TestReAddedRunKeepsOnePlace(t *testing.T) {
	e := newEnvWith(t, mesh.ServerConfig{}, nil, func(c *Config) { c.MaxRuns, c.Store = 2, openStore(t) })
	first := e.startEnded(t, "k1").GetRunId()
	rn, err := e.srv.get(first)
	if err != nil {
		t.Fatal(err)
	}
	e.srv.add(rn) // as resume's launch adds a run that came back
	for _, k := range []string{"k2", "k3", "k4"} {
		e.startEnded(t, k)
	}
	e.srv.mu.Lock()
	defer e.srv.mu.Unlock()
	if len(e.srv.order) != len(e.srv.runs) {
		t.Errorf("the table orders %d ids for %d runs", len(e.srv.order), len(e.srv.runs))
	}
}

// A start during a store outage waits for the store, within the call's deadline, and
// the run starts once the store is back. The try that the store committed without
// answering is recognised as this run by the next (its id was chosen before the first
// try, and so was its idempotency key's run): one run, which succeeds, not two and not
// an error.
func TestStartWaitsForTheStore(t *testing.T) {
	for _, key := range []string{"", "start-once"} {
		t.Run("key="+key, func(t *testing.T) {
			st := &createOutage{Store: openStore(t)}
			e, _ := newStoreWaitEnv(t, st)
			st.down.Store(true)
			type answer struct {
				resp *orchestratorv1.StartRunResponse
				err  error
			}
			done := make(chan answer, 1)
			go func() {
				resp, err := e.orch.StartRun(context.Background(), &orchestratorv1.StartRunRequest{Task: fastPlan,
					IdempotencyKey: key, Timeout: durationpb.New(30 * time.Second)})
				done <- answer{resp, err}
			}()
			for until := time.Now().Add(10 * time.Second); st.refused.Load() < 3; time.Sleep(5 * time.Millisecond) {
				if time.Now().After(until) {
					t.Fatalf("the store refused %d creates, want 3", st.refused.Load())
				}
			}
			select {
			case a := <-done:
				t.Fatalf("StartRun answered during the outage: %v %v, want it to wait", a.resp, a.err)
			default:
			}
			if n := testutil.ToFloat64(e.srv.leaseMetrics.waiting); n != 1 {
				t.Errorf("curfew_runs_waiting_for_store = %v while the start waits, want 1", n)
			}

			st.ambiguous.Store(true)
			st.down.Store(false)
			var a answer
			select {
			case a = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("StartRun still waiting 10 s after the store came back")
			}
			if a.err != nil {
				t.Fatalf("StartRun after the outage: %v", a.err)
			}
			if st.ambiguous.Load() {
				t.Fatal("no create was committed without an answer: the test did not test that")
			}
			id := a.resp.GetRun().GetRunId()
			if r := e.waitEndedWithin(t, id, 10*time.Second); r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
				t.Fatalf("run ended %v %s: %s, want SUCCEEDED", r.GetStatus(), r.GetErrorCode(), r.GetErrorMessage())
			}
			runs, _, err := st.ListRuns(context.Background(), store.RunQuery{Tenant: md.DefaultTenant})
			if err != nil || len(runs) != 1 || runs[0].RunID != id {
				t.Fatalf("the store holds %d runs (%v), want the one run %s", len(runs), err, id)
			}
			if n := testutil.ToFloat64(e.srv.leaseMetrics.waiting); n != 0 {
				t.Errorf("curfew_runs_waiting_for_store = %v after the wait, want 0", n)
			}
		})
	}
}
