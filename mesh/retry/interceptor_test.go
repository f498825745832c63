package retry_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// failFirst fails the first n attempts with err.
func failFirst(n int, err error) func(context.Context, int) error {
	return func(_ context.Context, i int) error {
		if i <= n {
			return err
		}
		return nil
	}
}

func listNodesCall(ctx context.Context, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
	resp, err := meshv1.NewNodeReportServiceClient(cc).ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "run-1"}, opts...)
	if err == nil && (len(resp.GetNodes()) != 1 || resp.GetNodes()[0].GetId() != "run-1") {
		return errors.New("unexpected response")
	}
	return err
}

func callCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// checkAttempts asserts the server saw one attempt per entry of want, numbered as want,
// all with one and the same retry-id, which it returns.
func checkAttempts(t *testing.T, got []seen, want ...string) string {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("server saw %d attempts, want %d", len(got), len(want))
	}
	id := got[0].retryID()
	if id == "" {
		t.Fatal("attempt without curfew-retry-id")
	}
	for i, s := range got {
		if len(s.retryIDs) != 1 || len(s.attempts) != 1 {
			t.Errorf("attempt %d: retry-id %q, attempt %q: want one value each", i+1, s.retryIDs, s.attempts)
		}
		if s.retryID() != id {
			t.Errorf("attempt %d: retry-id %q, want %q as on attempt 1", i+1, s.retryID(), id)
		}
		if s.attempt() != want[i] {
			t.Errorf("attempt %d: curfew-attempt %q, want %q", i+1, s.attempt(), want[i])
		}
	}
	return id
}

func TestUnaryRetriesUnavailableUntilSuccess(t *testing.T) {
	svc := &nodes{fail: failFirst(2, status.Error(codes.Unavailable, "warming up"))}
	reg := prometheus.NewRegistry()
	sl := &sleeper{}
	cc := dial(t, serve(t, svc, nil), retry.Config{Target: "nodes", Metrics: retry.NewMetrics(reg),
		Rand: constRand(0.75), Sleep: sl.Sleep})

	if err := listNodesCall(callCtx(t), cc); err != nil {
		t.Fatalf("call failed: %v", err)
	}
	id := checkAttempts(t, svc.all(), "1", "2", "3")
	if u, err := uuid.Parse(id); err != nil || u.Version() != 7 {
		t.Errorf("retry-id %q is not a UUIDv7 (%v)", id, err)
	}

	// Full jitter with rnd 0.75 under ceilings 25 ms and 50 ms.
	waits := sl.waits()
	want := []time.Duration{18750 * time.Microsecond, 37500 * time.Microsecond}
	if len(waits) != 2 || waits[0] != want[0] || waits[1] != want[1] {
		t.Fatalf("waits %v, want %v", waits, want)
	}

	attempts := func(code string, retried bool) float64 {
		r := "false"
		if retried {
			r = "true"
		}
		return metric(t, reg, "curfew_retry_attempts_total", map[string]string{"target": "nodes", "method": listNodes, "code": code, "retry": r})
	}
	if a, b, c := attempts("Unavailable", false), attempts("Unavailable", true), attempts("OK", true); a != 1 || b != 1 || c != 1 {
		t.Errorf("attempts: first Unavailable %v, retried Unavailable %v, retried OK %v; want 1 each", a, b, c)
	}
	if n := testutil.CollectAndCount(reg, "curfew_retry_attempts_total"); n != 3 {
		t.Errorf("%d attempt series, want 3", n)
	}
	count, sum := metricSum(t, reg, "curfew_backoff_delay_seconds", map[string]string{"target": "nodes", "method": listNodes})
	if count != 2 || sum < 0.05624 || sum > 0.05626 {
		t.Errorf("backoff histogram: %v samples summing to %v, want 2 summing to 0.05625", count, sum)
	}
	if n := metric(t, reg, "curfew_retry_budget_exhausted_total", nil); n != 0 {
		t.Errorf("budget exhausted %v times", n)
	}
}

func TestUnaryBackoffGrowsWithinCeilings(t *testing.T) {
	svc := &nodes{fail: failFirst(4, status.Error(codes.Unavailable, "down"))}
	sl := &sleeper{}
	// A random source near the top of its range, so the waits sit just under the ceilings.
	rnd := []float64{0.97, 0.99, 0.95, almostOne}
	i := 0
	cfg := retry.Config{Default: retry.Policy{MaxAttempts: 5, Base: 20 * time.Millisecond, Cap: 100 * time.Millisecond},
		Rand: func() float64 { v := rnd[i%len(rnd)]; i++; return v }, Sleep: sl.Sleep}
	cc := dial(t, serve(t, svc, nil), cfg)
	if err := listNodesCall(callCtx(t), cc); err != nil {
		t.Fatalf("call failed: %v", err)
	}
	checkAttempts(t, svc.all(), "1", "2", "3", "4", "5")
	ceilings := []time.Duration{20 * time.Millisecond, 40 * time.Millisecond, 80 * time.Millisecond, 100 * time.Millisecond}
	waits := sl.waits()
	if len(waits) != len(ceilings) {
		t.Fatalf("waits %v, want %d", waits, len(ceilings))
	}
	for k, w := range waits {
		if w < 0 || w >= ceilings[k] || w < ceilings[k]*9/10 {
			t.Errorf("wait %d = %v, want in [0.9, 1) × %v", k+1, w, ceilings[k])
		}
		if k > 0 && w <= waits[k-1] {
			t.Errorf("wait %d = %v did not grow from %v", k+1, w, waits[k-1])
		}
	}
}

func TestUnaryKeepsCallersRetryIDAndAttempt(t *testing.T) {
	svc := &nodes{fail: failFirst(1, status.Error(codes.Unavailable, "down"))}
	cc := dial(t, serve(t, svc, nil), retry.Config{Sleep: (&sleeper{}).Sleep})
	ctx := metadata.AppendToOutgoingContext(callCtx(t), md.RetryID, "caller-minted", md.Attempt, "2")
	if err := listNodesCall(ctx, cc); err != nil {
		t.Fatalf("call failed: %v", err)
	}
	if id := checkAttempts(t, svc.all(), "2", "3"); id != "caller-minted" {
		t.Fatalf("retry-id %q, want the caller's", id)
	}

	// Only the retry-id given: attempts count from 1.
	svc2 := &nodes{fail: failFirst(1, status.Error(codes.Unavailable, "down"))}
	cc2 := dial(t, serve(t, svc2, nil), retry.Config{Sleep: (&sleeper{}).Sleep})
	ctx2 := metadata.AppendToOutgoingContext(callCtx(t), md.RetryID, "id-only")
	if err := listNodesCall(ctx2, cc2); err != nil {
		t.Fatalf("call failed: %v", err)
	}
	if id := checkAttempts(t, svc2.all(), "1", "2"); id != "id-only" {
		t.Fatalf("retry-id %q, want the caller's", id)
	}

	// Two logical calls get two retry-ids.
	svc3 := &nodes{}
	cc3 := dial(t, serve(t, svc3, nil), retry.Config{})
	for range 2 {
		if err := listNodesCall(callCtx(t), cc3); err != nil {
			t.Fatal(err)
		}
	}
	if s := svc3.all(); len(s) != 2 || s[0].retryID() == s[1].retryID() || s[0].attempt() != "1" || s[1].attempt() != "1" {
		t.Fatalf("two calls: %+v, want distinct retry-ids, attempt 1 each", s)
	}
}

func TestUnaryExhaustionMarksError(t *testing.T) {
	st, err := status.New(codes.Unavailable, "backend gone").WithDetails(&errdetails.DebugInfo{Detail: "pod-3"})
	if err != nil {
		t.Fatal(err)
	}
	svc := &nodes{fail: func(context.Context, int) error { return st.Err() }}
	reg := prometheus.NewRegistry()
	cc := dial(t, serve(t, svc, nil), retry.Config{Target: "nodes", Metrics: retry.NewMetrics(reg), Sleep: (&sleeper{}).Sleep})
	err = listNodesCall(callCtx(t), cc)
	checkAttempts(t, svc.all(), "1", "2", "3")
	if !retry.IsExhausted(err) {
		t.Fatalf("error %v not marked exhausted", err)
	}
	got := status.Convert(err)
	if got.Code() != codes.Unavailable || got.Message() != "backend gone" {
		t.Errorf("error %v %q, want UNAVAILABLE %q", got.Code(), got.Message(), "backend gone")
	}
	var debug, marker bool
	for _, d := range got.Details() {
		switch d := d.(type) {
		case *errdetails.DebugInfo:
			debug = d.GetDetail() == "pod-3"
		case *errdetails.ErrorInfo:
			marker = d.GetMetadata()["attempts"] == "3"
		}
	}
	if !debug || !marker {
		t.Errorf("details %v: want the server's DebugInfo kept and a marker with attempts=3", got.Details())
	}
	if n := metric(t, reg, "curfew_retry_attempts_total", map[string]string{"code": "Unavailable"}); n != 3 {
		t.Errorf("%v Unavailable attempts counted, want 3", n)
	}
}

func TestUnaryDoesNotRetryErrorExhaustedBelow(t *testing.T) {
	svc := &nodes{fail: func(context.Context, int) error {
		return retry.MarkExhausted(status.Error(codes.Unavailable, "modelproxy down"), 3)
	}}
	sl := &sleeper{}
	cc := dial(t, serve(t, svc, nil), retry.Config{Sleep: sl.Sleep})
	err := listNodesCall(callCtx(t), cc)
	checkAttempts(t, svc.all(), "1")
	if !retry.IsExhausted(err) || status.Code(err) != codes.Unavailable {
		t.Fatalf("error %v, want the marked UNAVAILABLE passed up", err)
	}
	if len(sl.waits()) != 0 {
		t.Fatalf("slept %v", sl.waits())
	}
}

func TestUnaryNotRetryable(t *testing.T) {
	for _, c := range []codes.Code{codes.Internal, codes.DeadlineExceeded, codes.Aborted, codes.InvalidArgument, codes.ResourceExhausted, codes.Unknown} {
		t.Run(c.String(), func(t *testing.T) {
			svc := &nodes{fail: failFirst(1, status.Error(c, "no"))}
			cc := dial(t, serve(t, svc, nil), retry.Config{Sleep: (&sleeper{}).Sleep})
			err := listNodesCall(callCtx(t), cc)
			checkAttempts(t, svc.all(), "1")
			if status.Code(err) != c || retry.IsExhausted(err) {
				t.Fatalf("error %v, want %v unmarked", err, c)
			}
		})
	}
}

func TestUnaryPushback(t *testing.T) {
	retryInfo := withRetryInfo(t, codes.ResourceExhausted, 300*time.Millisecond)
	trailer := func(v string, c codes.Code) func(context.Context, int) error {
		return func(ctx context.Context, n int) error {
			if n > 1 {
				return nil
			}
			if err := grpc.SetTrailer(ctx, metadata.Pairs(retry.PushbackHeader, v)); err != nil {
				return err
			}
			return status.Error(c, "slow down")
		}
	}
	for _, tc := range []struct {
		name     string
		fail     func(context.Context, int) error
		attempts []string
		waits    []time.Duration
		code     codes.Code
	}{
		{"trailer on unavailable", trailer("500", codes.Unavailable), []string{"1", "2"}, []time.Duration{500 * time.Millisecond}, codes.OK},
		{"trailer on resource exhausted", trailer("250", codes.ResourceExhausted), []string{"1", "2"}, []time.Duration{250 * time.Millisecond}, codes.OK},
		{"retry info on resource exhausted", func(_ context.Context, n int) error {
			if n > 1 {
				return nil
			}
			return retryInfo
		}, []string{"1", "2"}, []time.Duration{300 * time.Millisecond}, codes.OK},
		{"negative trailer", trailer("-1", codes.Unavailable), []string{"1"}, nil, codes.Unavailable},
		{"malformed trailer", trailer("later", codes.Unavailable), []string{"1"}, nil, codes.Unavailable},
		{"negative trailer on resource exhausted", trailer("-1", codes.ResourceExhausted), []string{"1"}, nil, codes.ResourceExhausted},
	} {
		t.Run(tc.name, func(t *testing.T) {
			svc := &nodes{fail: tc.fail}
			sl := &sleeper{}
			cc := dial(t, serve(t, svc, nil), retry.Config{Rand: constRand(0.5), Sleep: sl.Sleep})
			err := listNodesCall(callCtx(t), cc)
			if status.Code(err) != tc.code {
				t.Fatalf("error %v, want %v", err, tc.code)
			}
			if retry.IsExhausted(err) {
				t.Errorf("error %v marked exhausted; a pushback stop is not exhaustion", err)
			}
			checkAttempts(t, svc.all(), tc.attempts...)
			waits := sl.waits()
			if len(waits) != len(tc.waits) {
				t.Fatalf("waits %v, want %v", waits, tc.waits)
			}
			for i := range waits {
				if waits[i] != tc.waits[i] {
					t.Errorf("wait %d = %v, want %v", i, waits[i], tc.waits[i])
				}
			}
		})
	}
}

func TestUnaryNoTimeLeftForPushback(t *testing.T) {
	svc := &nodes{fail: func(ctx context.Context, n int) error {
		if n == 1 {
			return nil // warm-up: connect before the timed call
		}
		_ = grpc.SetTrailer(ctx, metadata.Pairs(retry.PushbackHeader, "2000"))
		return status.Error(codes.Unavailable, "overloaded")
	}}
	sl := &sleeper{}
	cc := dial(t, serve(t, svc, nil), retry.Config{Sleep: sl.Sleep})
	if err := listNodesCall(callCtx(t), cc); err != nil {
		t.Fatalf("warm-up: %v", err)
	}
	// The deadline is shorter than the pushback (with margin for a loaded machine).
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	start := time.Now()
	err := listNodesCall(ctx, cc)
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(status.Convert(err).Message(), "no time left to retry") {
		t.Fatalf("error %v, want DEADLINE_EXCEEDED: no time left to retry", err)
	}
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "Unavailable") || !strings.Contains(msg, "overloaded") {
		t.Errorf("message %q does not say what the attempt failed with", msg)
	}
	if s := svc.all(); len(s) != 2 {
		t.Fatalf("server saw %d attempts of the timed call, want 1", len(s)-1)
	}
	if len(sl.waits()) != 0 {
		t.Fatalf("slept %v past the deadline", sl.waits())
	}
	if el := time.Since(start); el > 900*time.Millisecond {
		t.Errorf("failed after %v: it should not wait for the deadline", el)
	}
}

func TestUnaryNoTimeLeftForBackoff(t *testing.T) {
	// Backoff ≈ 0 but MinAttemptTime larger than the deadline: never start the 2nd attempt.
	svc := &nodes{fail: failFirst(5, status.Error(codes.Unavailable, "down"))}
	sl := &sleeper{}
	cc := dial(t, serve(t, svc, nil), retry.Config{Default: retry.Policy{MinAttemptTime: time.Hour}, Rand: constRand(0), Sleep: sl.Sleep})
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	err := listNodesCall(ctx, cc)
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "no time left to retry") {
		t.Fatalf("error %v, want DEADLINE_EXCEEDED: no time left to retry", err)
	}
	checkAttempts(t, svc.all(), "1")
	if len(sl.waits()) != 0 {
		t.Fatalf("slept %v", sl.waits())
	}
}

func TestUnaryBudgetExhaustion(t *testing.T) {
	svc := &nodes{fail: func(context.Context, int) error { return status.Error(codes.Unavailable, "down") }}
	reg := prometheus.NewRegistry()
	clk := newClock()
	sl := &sleeper{}
	// Retries may add 50 % of requests, no floor: the first call's retry is refused (0.5
	// of 1), the second call may retry once (1 of 2) and then is refused.
	cfg := retry.Config{Target: "nodes", Budget: retry.BudgetConfig{Ratio: 0.5}, Metrics: retry.NewMetrics(reg),
		Now: clk.Now, Sleep: sl.Sleep}
	cc := dial(t, serve(t, svc, nil), cfg)

	err := listNodesCall(context.Background(), cc)
	if status.Code(err) != codes.Unavailable || !retry.IsExhausted(err) {
		t.Fatalf("call 1: %v, want UNAVAILABLE marked exhausted", err)
	}
	if n := len(svc.all()); n != 1 {
		t.Fatalf("call 1 made %d attempts, want 1", n)
	}
	if n := metric(t, reg, "curfew_retry_budget_exhausted_total", map[string]string{"target": "nodes"}); n != 1 {
		t.Fatalf("budget exhausted counted %v, want 1", n)
	}

	err = listNodesCall(context.Background(), cc)
	if status.Code(err) != codes.Unavailable || !retry.IsExhausted(err) {
		t.Fatalf("call 2: %v, want UNAVAILABLE marked exhausted", err)
	}
	if n := len(svc.all()); n != 3 {
		t.Fatalf("call 2 made %d attempts, want 2", n-1)
	}
	want := `
# HELP curfew_retry_budget_exhausted_total Retries refused because the target's retry budget was spent.
# TYPE curfew_retry_budget_exhausted_total counter
curfew_retry_budget_exhausted_total{target="nodes"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "curfew_retry_budget_exhausted_total"); err != nil {
		t.Fatalf("budget exhausted metric: %v", err)
	}
	if got := sl.waits(); len(got) != 1 {
		t.Fatalf("waits %v, want one (call 2's only retry)", got)
	}
}

func TestUnarySideEffect(t *testing.T) {
	svc := &nodes{}
	cc := dial(t, serve(t, svc, nil), retry.Config{Sleep: (&sleeper{}).Sleep})

	// Marked as a side effect, without an idempotency key: one attempt, error unmarked.
	svc.fail = failFirst(1, status.Error(codes.Unavailable, "lost ack"))
	err := listNodesCall(callCtx(t), cc, retry.SideEffect())
	if status.Code(err) != codes.Unavailable || retry.IsExhausted(err) {
		t.Fatalf("side effect without key: %v, want UNAVAILABLE unmarked", err)
	}
	if n := len(svc.all()); n != 1 {
		t.Fatalf("side effect without key: %d attempts, want 1", n)
	}

	// With a key: retried, and the key travels on every attempt.
	svc2 := &nodes{fail: failFirst(1, status.Error(codes.Unavailable, "lost ack"))}
	cc2 := dial(t, serve(t, svc2, nil), retry.Config{Sleep: (&sleeper{}).Sleep})
	ctx := metadata.AppendToOutgoingContext(callCtx(t), md.IdempotencyKey, "deploy-42")
	if err := listNodesCall(ctx, cc2, retry.SideEffect()); err != nil {
		t.Fatalf("side effect with key: %v", err)
	}
	got := svc2.all()
	checkAttempts(t, got, "1", "2")
	for i, s := range got {
		if s.key != "deploy-42" {
			t.Errorf("attempt %d: idempotency key %q", i+1, s.key)
		}
	}

	// The same through the method's policy instead of the call option.
	svc3 := &nodes{fail: failFirst(1, status.Error(codes.Unavailable, "lost ack"))}
	cc3 := dial(t, serve(t, svc3, nil), retry.Config{Methods: map[string]retry.Policy{listNodes: {NonIdempotent: true}},
		Sleep: (&sleeper{}).Sleep})
	if err := listNodesCall(callCtx(t), cc3); status.Code(err) != codes.Unavailable {
		t.Fatalf("non-idempotent method without key: %v, want UNAVAILABLE", err)
	}
	if err := listNodesCall(metadata.AppendToOutgoingContext(callCtx(t), md.IdempotencyKey, "k"), cc3); err != nil {
		t.Fatalf("non-idempotent method with key: %v", err)
	}
	if n := len(svc3.all()); n != 2 {
		t.Fatalf("%d attempts in all, want 1 + 1", n)
	}
}

func TestUnaryDisabled(t *testing.T) {
	svc := &nodes{fail: failFirst(1, status.Error(codes.Unavailable, "down"))}
	cc := dial(t, serve(t, svc, nil), retry.Config{Default: retry.Policy{Disabled: true}, Sleep: (&sleeper{}).Sleep})
	err := listNodesCall(callCtx(t), cc)
	if status.Code(err) != codes.Unavailable || retry.IsExhausted(err) {
		t.Fatalf("error %v, want UNAVAILABLE unmarked", err)
	}
	checkAttempts(t, svc.all(), "1")
}

func TestUnaryPerMethodPolicy(t *testing.T) {
	svc := &nodes{fail: func(context.Context, int) error { return status.Error(codes.Unavailable, "down") }}
	cfg := retry.Config{
		Default: retry.Policy{Disabled: true},
		Methods: map[string]retry.Policy{listNodes: {MaxAttempts: 4}},
		Sleep:   (&sleeper{}).Sleep,
	}
	cc := dial(t, serve(t, svc, nil), cfg)
	err := listNodesCall(callCtx(t), cc)
	if !retry.IsExhausted(err) {
		t.Fatalf("ListNodes: %v, want exhausted", err)
	}
	checkAttempts(t, svc.all(), "1", "2", "3", "4")

	_, err = meshv1.NewNodeReportServiceClient(cc).CancelNodes(callCtx(t), &meshv1.CancelNodesRequest{RunId: "r"})
	if status.Code(err) != codes.Unavailable || retry.IsExhausted(err) {
		t.Fatalf("CancelNodes: %v, want UNAVAILABLE unmarked (default: disabled)", err)
	}
	if n := len(svc.all()); n != 5 {
		t.Fatalf("CancelNodes made %d attempts, want 1", n-4)
	}
}

// fakeInvoker answers attempts from a script, without a server.
type fakeInvoker struct {
	results []error  // attempt i returns results[i] (the last one repeats)
	push    []string // trailer pushback per attempt, "" for none
	calls   []metadata.MD
}

func (f *fakeInvoker) invoke(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, opts ...grpc.CallOption) error {
	out, _ := metadata.FromOutgoingContext(ctx)
	f.calls = append(f.calls, out)
	i := len(f.calls) - 1
	if i < len(f.push) && f.push[i] != "" {
		for _, o := range opts {
			if tr, ok := o.(grpc.TrailerCallOption); ok {
				*tr.TrailerAddr = metadata.Pairs(retry.PushbackHeader, f.push[i])
			}
		}
	}
	return f.results[min(i, len(f.results)-1)]
}

func TestUnaryCancelledWhileBackingOff(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	inv := &fakeInvoker{results: []error{status.Error(codes.Unavailable, "down")}}
	sleeps := 0
	icpt := retry.UnaryClientInterceptor(retry.Config{Logger: quiet(), Sleep: func(ctx context.Context, _ time.Duration) error {
		sleeps++
		cancel()
		return ctx.Err()
	}})
	err := icpt(ctx, listNodes, nil, nil, nil, inv.invoke)
	if status.Code(err) != codes.Unavailable || retry.IsExhausted(err) {
		t.Fatalf("error %v, want the attempt's UNAVAILABLE, unmarked", err)
	}
	if len(inv.calls) != 1 || sleeps != 1 {
		t.Fatalf("%d attempts, %d sleeps; want 1 and 1", len(inv.calls), sleeps)
	}
}

func TestUnaryRealSleepHonoursPushback(t *testing.T) {
	// The default Sleep waits the pushback: 60 ms between the attempts.
	inv := &fakeInvoker{results: []error{status.Error(codes.Unavailable, "down"), nil}, push: []string{"60"}}
	icpt := retry.UnaryClientInterceptor(retry.Config{Logger: quiet()})
	start := time.Now()
	if err := icpt(context.Background(), listNodes, nil, nil, nil, inv.invoke); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el < 60*time.Millisecond {
		t.Fatalf("retried after %v, before the 60 ms pushback", el)
	}
	// Cancelled during the real sleep: returns promptly with the attempt's error.
	inv2 := &fakeInvoker{results: []error{status.Error(codes.Unavailable, "down")}, push: []string{"60000"}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	time.AfterFunc(50*time.Millisecond, cancel)
	start = time.Now()
	err := icpt(ctx, listNodes, nil, nil, nil, inv2.invoke)
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("error %v, want UNAVAILABLE", err)
	}
	if el := time.Since(start); el > 10*time.Second {
		t.Fatalf("took %v: the sleep ignored cancellation", el)
	}
	if len(inv2.calls) != 1 {
		t.Fatalf("%d attempts, want 1", len(inv2.calls))
	}
}

func TestUnaryThrottle(t *testing.T) {
	clk := newClock()
	inv := &fakeInvoker{results: []error{status.Error(codes.Unavailable, "overloaded")}}
	reg := prometheus.NewRegistry()
	icpt := retry.UnaryClientInterceptor(retry.Config{Target: "t", Throttle: true, Default: retry.Policy{Disabled: true},
		Metrics: retry.NewMetrics(reg), Now: clk.Now, Rand: constRand(0.9), Logger: quiet()})
	// Call k sees k−1 unanswered requests: rejected once (k−1)/k > 0.9, from call 11 on.
	for k := 1; k <= 10; k++ {
		if err := icpt(context.Background(), listNodes, nil, nil, nil, inv.invoke); status.Code(err) != codes.Unavailable || strings.Contains(err.Error(), "throttled") {
			t.Fatalf("call %d: %v, want the backend's UNAVAILABLE", k, err)
		}
	}
	err := icpt(context.Background(), listNodes, nil, nil, nil, inv.invoke)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "throttled") {
		t.Fatalf("call 11: %v, want UNAVAILABLE throttled on the client", err)
	}
	if len(inv.calls) != 10 {
		t.Fatalf("%d calls reached the backend, want 10", len(inv.calls))
	}
	// Accepted answers reset it: a fresh client whose backend answers is never throttled.
	ok := &fakeInvoker{results: []error{status.Error(codes.NotFound, "no such run")}}
	icpt2 := retry.UnaryClientInterceptor(retry.Config{Throttle: true, Now: clk.Now, Rand: constRand(0), Logger: quiet()})
	for k := range 100 {
		if err := icpt2(context.Background(), listNodes, nil, nil, nil, ok.invoke); status.Code(err) != codes.NotFound {
			t.Fatalf("call %d: %v, want NOT_FOUND from the backend", k+1, err)
		}
	}
}

func TestUnaryDirectAttemptsMetadata(t *testing.T) {
	inv := &fakeInvoker{results: []error{status.Error(codes.Unavailable, "a"), status.Error(codes.Unavailable, "b"), nil}}
	icpt := retry.UnaryClientInterceptor(retry.Config{Sleep: (&sleeper{}).Sleep, Logger: quiet()})
	ctx := metadata.AppendToOutgoingContext(context.Background(), "x-other", "kept")
	if err := icpt(ctx, listNodes, nil, nil, nil, inv.invoke); err != nil {
		t.Fatal(err)
	}
	if len(inv.calls) != 3 {
		t.Fatalf("%d attempts, want 3", len(inv.calls))
	}
	id := inv.calls[0].Get(md.RetryID)
	if len(id) != 1 || id[0] == "" {
		t.Fatalf("attempt 1: retry-id %q", id)
	}
	for i, m := range inv.calls {
		if got := m.Get(md.Attempt); len(got) != 1 || got[0] != []string{"1", "2", "3"}[i] {
			t.Errorf("attempt %d: curfew-attempt %q", i+1, got)
		}
		if got := m.Get(md.RetryID); len(got) != 1 || got[0] != id[0] {
			t.Errorf("attempt %d: retry-id %q, want %q", i+1, got, id)
		}
		if got := m.Get("x-other"); len(got) != 1 || got[0] != "kept" {
			t.Errorf("attempt %d: x-other %q, want kept", i+1, got)
		}
	}
}
