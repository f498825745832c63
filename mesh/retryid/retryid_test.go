package retryid_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retryid"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	method = "/curfew.toolrunner.v1.ToolRunnerService/Execute"
	other  = "/curfew.mesh.v1.NodeReportService/ListNodes"
	// long bounds waits that only a broken implementation exhausts.
	long = 10 * time.Second
)

func attemptCtx(tenant, retryID string, attempt int) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{Tenant: tenant, RetryID: retryID, Attempt: attempt})
}

type admitted struct {
	ctx     context.Context
	release func()
	err     error
	// flag is the value of the flag passed to admitAsync when Admit returned.
	flag bool
}

// admitAsync admits in a goroutine; the result arrives on the channel. flag, if not nil,
// is read the moment Admit returns.
func admitAsync(ctx context.Context, tb *retryid.Table, m string, flag *atomic.Bool) <-chan admitted {
	ch := make(chan admitted, 1)
	go func() {
		c, r, err := tb.Admit(ctx, m)
		a := admitted{ctx: c, release: r, err: err}
		if flag != nil {
			a.flag = flag.Load()
		}
		ch <- a
	}()
	return ch
}

func mustAdmit(ctx context.Context, t *testing.T, tb *retryid.Table, m string) (context.Context, func()) {
	t.Helper()
	c, r, err := tb.Admit(ctx, m)
	if err != nil {
		t.Fatalf("Admit: %v", err)
	}
	return c, r
}

func waitDone(ctx context.Context, t *testing.T, what string) {
	t.Helper()
	select {
	case <-ctx.Done():
	case <-time.After(long):
		t.Fatalf("%s: context not cancelled", what)
	}
}

func recvAdmitted(t *testing.T, ch <-chan admitted, what string) admitted {
	t.Helper()
	select {
	case a := <-ch:
		return a
	case <-time.After(long):
		t.Fatalf("%s: Admit did not return", what)
		return admitted{}
	}
}

// value reads the series of name with method label m from reg (0 when absent).
func value(t *testing.T, reg *prometheus.Registry, name, m string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, s := range mf.GetMetric() {
			if label(s, "method") == m {
				if s.GetCounter() != nil {
					return s.GetCounter().GetValue()
				}
				return s.GetGauge().GetValue()
			}
		}
	}
	return 0
}

func label(s *dto.Metric, name string) string {
	for _, l := range s.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func TestAdmitWithoutRetryIDPassesThrough(t *testing.T) {
	reg := prometheus.NewRegistry()
	tb := retryid.New(0, reg)
	ctx := attemptCtx("acme", "", 2)
	for range 3 { // any number at once
		got, release, err := tb.Admit(ctx, method)
		if err != nil || got != ctx {
			t.Fatalf("Admit without retry-id = %v, %v; want the same context, no error", got, err)
		}
		release()
	}
	bare := context.Background()
	if got, release, err := tb.Admit(bare, method); err != nil || got != bare {
		t.Fatalf("Admit without identity = %v, %v", got, err)
	} else {
		release()
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 0 {
		t.Fatalf("inflight %v for calls without retry-id", v)
	}
}

func TestSupersedeWaitsForRelease(t *testing.T) {
	reg := prometheus.NewRegistry()
	tb := retryid.New(long, reg)
	ctx1, release1 := mustAdmit(attemptCtx("acme", "r1", 1), t, tb, method)
	if err := ctx1.Err(); err != nil {
		t.Fatalf("attempt 1 started cancelled: %v", err)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 1 {
		t.Fatalf("inflight %v with attempt 1 running, want 1", v)
	}

	var released atomic.Bool
	second := admitAsync(attemptCtx("acme", "r1", 2), tb, method, &released)
	waitDone(ctx1, t, "attempt 1")
	if cause := context.Cause(ctx1); !errors.Is(cause, cancel.ErrSuperseded) {
		t.Fatalf("attempt 1's cause = %v, want ErrSuperseded", cause)
	}
	if cancel.CauseOf(ctx1).String() != "CANCEL_CAUSE_SUPERSEDED" {
		t.Fatalf("attempt 1's wire cause = %v", cancel.CauseOf(ctx1))
	}
	// Attempt 2 must still be waiting for attempt 1's teardown.
	select {
	case a := <-second:
		t.Fatalf("attempt 2 admitted (err %v) before attempt 1 released", a.err)
	case <-time.After(50 * time.Millisecond):
	}
	released.Store(true)
	release1()
	a := recvAdmitted(t, second, "attempt 2")
	if a.err != nil {
		t.Fatalf("attempt 2: %v", a.err)
	}
	if !a.flag {
		t.Fatal("attempt 2 admitted before attempt 1 released")
	}
	if a.ctx.Err() != nil {
		t.Fatalf("attempt 2 started cancelled: %v", context.Cause(a.ctx))
	}
	if v := value(t, reg, "curfew_superseded_total", method); v != 1 {
		t.Errorf("superseded %v, want 1", v)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 1 {
		t.Errorf("inflight %v with attempt 2 running, want 1", v)
	}
	a.release()
	if a.ctx.Err() == nil {
		t.Error("attempt 2's context outlives its release")
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 0 {
		t.Errorf("inflight %v after every release, want 0", v)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id_max", method); v != 1 {
		t.Errorf("inflight max %v, want 1", v)
	}
	// The key is free again: a later attempt runs without superseding anyone.
	_, r3 := mustAdmit(attemptCtx("acme", "r1", 3), t, tb, method)
	r3()
	if v := value(t, reg, "curfew_superseded_total", method); v != 1 {
		t.Errorf("superseded %v after a free attempt 3, want still 1", v)
	}
}

func TestSupersedeChain(t *testing.T) {
	tb := retryid.New(long, nil)
	ctx1, r1 := mustAdmit(attemptCtx("t", "chain", 1), t, tb, method)
	second := admitAsync(attemptCtx("t", "chain", 2), tb, method, nil)
	waitDone(ctx1, t, "attempt 1")
	r1()
	a2 := recvAdmitted(t, second, "attempt 2")
	if a2.err != nil {
		t.Fatal(a2.err)
	}
	third := admitAsync(attemptCtx("t", "chain", 3), tb, method, nil)
	waitDone(a2.ctx, t, "attempt 2")
	if !errors.Is(context.Cause(a2.ctx), cancel.ErrSuperseded) {
		t.Fatalf("attempt 2's cause = %v", context.Cause(a2.ctx))
	}
	a2.release()
	a3 := recvAdmitted(t, third, "attempt 3")
	if a3.err != nil {
		t.Fatal(a3.err)
	}
	a3.release()
}

func TestSupersededAttemptPastGraceAborts(t *testing.T) {
	reg := prometheus.NewRegistry()
	grace := 50 * time.Millisecond
	tb := retryid.New(grace, reg)
	ctx1, release1 := mustAdmit(attemptCtx("acme", "stuck", 1), t, tb, method)
	released := false
	defer func() {
		if !released {
			release1()
		}
	}()
	start := time.Now()
	a := recvAdmitted(t, admitAsync(attemptCtx("acme", "stuck", 2), tb, method, nil), "attempt 2")
	el := time.Since(start)
	if status.Code(a.err) != codes.Aborted || !strings.Contains(a.err.Error(), "did not stop within") {
		t.Fatalf("attempt 2: %v, want ABORTED past the grace", a.err)
	}
	if el < grace {
		t.Fatalf("aborted after %v, before the %v grace", el, grace)
	}
	if !errors.Is(context.Cause(ctx1), cancel.ErrSuperseded) {
		t.Fatalf("attempt 1's cause = %v, want ErrSuperseded", context.Cause(ctx1))
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 1 {
		t.Fatalf("inflight %v, want 1 (attempt 1 still running)", v)
	}
	// Once attempt 1 finally stops, a later attempt runs at once.
	released = true
	release1()
	_, r3 := mustAdmit(attemptCtx("acme", "stuck", 3), t, tb, method)
	r3()
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 0 {
		t.Fatalf("inflight %v after all released, want 0", v)
	}
}

func TestWaitingAttemptHonoursItsContext(t *testing.T) {
	tb := retryid.New(long, nil)
	_, release1 := mustAdmit(attemptCtx("acme", "r", 1), t, tb, method)
	defer release1()
	ctx, stop := context.WithTimeout(attemptCtx("acme", "r", 2), 30*time.Millisecond)
	defer stop()
	start := time.Now()
	_, _, err := tb.Admit(ctx, method)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("attempt 2: %v, want DEADLINE_EXCEEDED from its own deadline", err)
	}
	if el := time.Since(start); el > long/2 {
		t.Fatalf("waited %v: the grace, not the caller's deadline", el)
	}
}

func TestLateDuplicateAborted(t *testing.T) {
	tb := retryid.New(long, nil)
	ctx2, release2 := mustAdmit(attemptCtx("acme", "dup", 2), t, tb, method)
	defer release2()
	for _, a := range []int{1, 2, 0} { // 0: no curfew-attempt, read as 1
		_, _, err := tb.Admit(attemptCtx("acme", "dup", a), method)
		if status.Code(err) != codes.Aborted || !strings.Contains(err.Error(), "late duplicate") {
			t.Errorf("attempt %d while 2 runs: %v, want ABORTED late duplicate", a, err)
		}
	}
	if ctx2.Err() != nil {
		t.Fatalf("a late duplicate cancelled the running attempt: %v", context.Cause(ctx2))
	}
}

func TestKeysDoNotInterfere(t *testing.T) {
	reg := prometheus.NewRegistry()
	tb := retryid.New(long, reg)
	ctxA, rA := mustAdmit(attemptCtx("tenant-a", "same", 1), t, tb, method)
	defer rA()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		m    string
	}{
		{"other tenant", attemptCtx("tenant-b", "same", 2), method},
		{"other method", attemptCtx("tenant-a", "same", 2), other},
		{"other retry-id", attemptCtx("tenant-a", "different", 2), method},
		{"other tenant, earlier attempt", attemptCtx("tenant-c", "same", 1), method},
	} {
		ch := admitAsync(tc.ctx, tb, tc.m, nil)
		a := recvAdmitted(t, ch, tc.name)
		if a.err != nil {
			t.Fatalf("%s: %v", tc.name, a.err)
		}
		if a.ctx.Err() != nil {
			t.Fatalf("%s: started cancelled", tc.name)
		}
		defer a.release()
	}
	if ctxA.Err() != nil {
		t.Fatalf("tenant-a's attempt cancelled by another key: %v", context.Cause(ctxA))
	}
	if v := value(t, reg, "curfew_superseded_total", method) + value(t, reg, "curfew_superseded_total", other); v != 0 {
		t.Fatalf("superseded %v across keys", v)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 4 {
		t.Fatalf("inflight %v, want 4 distinct keys on %s", v, method)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id_max", method); v != 1 {
		t.Fatalf("inflight max %v, want 1", v)
	}
}

func TestManyConcurrentAttemptsNeverOverlap(t *testing.T) {
	reg := prometheus.NewRegistry()
	tb := retryid.New(long, reg)
	var running, maxRunning atomic.Int32
	done := make(chan error, 5)
	for a := 1; a <= 5; a++ {
		go func() {
			ctx, release, err := tb.Admit(attemptCtx("acme", "storm", a), method)
			if err != nil {
				done <- err
				return
			}
			n := running.Add(1)
			for {
				m := maxRunning.Load()
				if n <= m || maxRunning.CompareAndSwap(m, n) {
					break
				}
			}
			select { // a handler that runs until superseded or a while passes
			case <-ctx.Done():
			case <-time.After(20 * time.Millisecond):
			}
			running.Add(-1)
			release()
			done <- nil
		}()
	}
	admitted, aborted := 0, 0
	for range 5 {
		select {
		case err := <-done:
			switch {
			case err == nil:
				admitted++
			case status.Code(err) == codes.Aborted:
				aborted++
			default:
				t.Fatalf("attempt: %v", err)
			}
		case <-time.After(long):
			t.Fatal("attempts did not finish")
		}
	}
	if maxRunning.Load() != 1 {
		t.Fatalf("%d attempts of one retry-id ran at once", maxRunning.Load())
	}
	if admitted == 0 || admitted+aborted != 5 {
		t.Fatalf("%d admitted, %d aborted", admitted, aborted)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 0 {
		t.Fatalf("inflight %v after all, want 0", v)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id_max", method); v != 1 {
		t.Fatalf("inflight max %v, want 1", v)
	}
}

// hedgeCtx is attemptCtx of a hedged call's backup: curfew-hedge: 1 on the incoming call.
func hedgeCtx(tenant, retryID string, attempt int) context.Context {
	return metadata.NewIncomingContext(attemptCtx(tenant, retryID, attempt), metadata.Pairs(md.Hedge, md.HedgeBackup))
}

// A hedged call's backup shares its twin's retry-id and attempt, yet runs beside it: it
// neither supersedes the twin nor is refused as a late duplicate, and a retry of the
// backup still supersedes the backup only.
func TestHedgeRunsBesideItsTwin(t *testing.T) {
	reg := prometheus.NewRegistry()
	tb := retryid.New(long, reg)
	primary, rP := mustAdmit(attemptCtx("acme", "twin", 1), t, tb, method)
	defer rP()
	backup, rB := mustAdmit(hedgeCtx("acme", "twin", 1), t, tb, method)
	if primary.Err() != nil || backup.Err() != nil {
		t.Fatalf("twins cancelled: primary %v, backup %v", context.Cause(primary), context.Cause(backup))
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", method); v != 2 {
		t.Fatalf("inflight %v, want the two twins", v)
	}
	ch := admitAsync(hedgeCtx("acme", "twin", 2), tb, method, nil)
	waitDone(backup, t, "the backup's retry")
	if !errors.Is(context.Cause(backup), cancel.ErrSuperseded) {
		t.Fatalf("backup's cause %v, want superseded", context.Cause(backup))
	}
	rB()
	a := recvAdmitted(t, ch, "the backup's retry")
	if a.err != nil {
		t.Fatalf("the backup's retry: %v", a.err)
	}
	a.release()
	if primary.Err() != nil {
		t.Fatalf("a retry of the backup cancelled the primary: %v", context.Cause(primary))
	}
}
