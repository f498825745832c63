package breaker_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/breaker"
)

func TestConsecutiveFailuresTrip(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := breaker.NewSet(breaker.Config{ConsecutiveFailures: 3, OpenTimeout: time.Hour}, reg).Get("tools")
	ctx := t.Context()
	for i, err := range []error{errUnavailable, errUnavailable, nil, errUnavailable, errUnavailable} {
		if aerr := call(ctx, b, err); aerr != nil {
			t.Fatalf("call %d refused: %v", i, aerr)
		}
	}
	if s := b.State(); s != breaker.StateClosed {
		t.Fatalf("state %s after a success broke the run of failures, want closed", s)
	}
	if g := stateGauges(t, reg, "tools"); g != [3]float64{1, 0, 0} {
		t.Errorf("state gauges closed/half-open/open = %v, want [1 0 0]", g)
	}
	if err := call(ctx, b, errUnavailable); err != nil { // the third in a row
		t.Fatal(err)
	}
	if s := b.State(); s != breaker.StateOpen {
		t.Fatalf("state %s after 3 consecutive failures, want open", s)
	}
	done, err := b.Allow(ctx)
	if done != nil {
		t.Fatal("open breaker returned a done func")
	}
	wantOpen(t, err, "tools", "open", 40*time.Minute, 72*time.Minute) // 1h ± 20 %, minus the test's time
	if g := stateGauges(t, reg, "tools"); g != [3]float64{0, 0, 1} {
		t.Errorf("state gauges = %v, want [0 0 1]", g)
	}
	lbl := func(from, to string) map[string]string {
		return map[string]string{"target": "tools", "from": from, "to": to}
	}
	if v := metric(t, reg, "curfew_circuit_breaker_transitions_total", lbl("closed", "open")); v != 1 {
		t.Errorf("closed→open transitions = %v, want 1", v)
	}
	if v := metric(t, reg, "curfew_circuit_breaker_transitions_total", map[string]string{"target": "tools"}); v != 1 {
		t.Errorf("transitions in all = %v, want 1", v)
	}
	calls := func(o string) float64 {
		return metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": "tools", "outcome": o})
	}
	if calls("failure") != 5 || calls("success") != 1 || calls("rejected") != 1 || calls("ignored") != 0 {
		t.Errorf("calls: failure %v success %v rejected %v ignored %v, want 5 1 1 0",
			calls("failure"), calls("success"), calls("rejected"), calls("ignored"))
	}
}

func TestRatioTripRespectsMinRequests(t *testing.T) {
	ctx := t.Context()
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	b := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1000, FailureRatio: 0.5, MinRequests: 10, Window: time.Hour, OpenTimeout: time.Hour}, nil).Get("model")
	// 9 failures, each followed by ignored outcomes that must not count as requests.
	for i := range 9 {
		if err := call(ctx, b, errUnavailable); err != nil {
			t.Fatalf("failure %d refused: %v", i+1, err)
		}
		for range 3 {
			if err := call(cancelled, b, errUnavailable); err != nil {
				t.Fatal(err)
			}
		}
	}
	if s := b.State(); s != breaker.StateClosed {
		t.Fatalf("state %s with 9 judged calls (MinRequests 10), want closed", s)
	}
	if err := call(ctx, b, errUnavailable); err != nil { // the 10th judged call: 10/10 failed
		t.Fatal(err)
	}
	if s := b.State(); s != breaker.StateOpen {
		t.Fatalf("state %s with 10 failures of 10 judged calls, want open", s)
	}

	// Below the ratio it never trips: 2 failures in 5 (F S F S S) over 100 calls, at most
	// 5/11 once 10 calls were judged.
	b = breaker.NewSet(breaker.Config{ConsecutiveFailures: 1000, FailureRatio: 0.5, MinRequests: 10, Window: time.Hour}, nil).Get("model")
	for i := range 100 {
		err := error(nil)
		if i%5 == 0 || i%5 == 2 {
			err = errUnavailable
		}
		if aerr := call(ctx, b, err); aerr != nil {
			t.Fatalf("call %d refused at a 40%% failure ratio: %v", i, aerr)
		}
	}
	// At the ratio it trips on the next failure: 3 in 5 from here.
	tripped := -1
	for i := range 100 {
		err := error(nil)
		if i%5 < 3 {
			err = errUnavailable
		}
		if call(ctx, b, err) != nil {
			tripped = i
			break
		}
	}
	// 40 failures in 100, then 3 in 5 (F F F S S): after n more calls with f failures the
	// ratio (40+f)/(100+n) first reaches 0.5 at n = 88, f = 54, so the call at index 88
	// is the first refused.
	if tripped != 88 {
		t.Fatalf("first refusal at call %d of the 60%% phase, want 88", tripped)
	}
}

func TestOpenPeriodJitter(t *testing.T) {
	c := breaker.Config{OpenTimeout: time.Second, Jitter: 0.2}
	for u, want := range map[float64]time.Duration{0: 800 * time.Millisecond, 0.5: time.Second, 0.25: 900 * time.Millisecond} {
		if got := c.OpenPeriod(u); got != want {
			t.Errorf("OpenPeriod(%v) = %v, want %v", u, got, want)
		}
	}
	if got := c.OpenPeriod(0.999999); got >= 1200*time.Millisecond || got < 1199*time.Millisecond {
		t.Errorf("OpenPeriod(0.999999) = %v, want just under 1.2s", got)
	}
	off := breaker.Config{OpenTimeout: time.Second, Jitter: -1}
	for _, u := range []float64{0, 0.5, 0.99} {
		if got := off.OpenPeriod(u); got != time.Second {
			t.Errorf("no jitter: OpenPeriod(%v) = %v, want 1s", u, got)
		}
	}
	if got := (breaker.Config{}).OpenPeriod(0); got != 4*time.Second {
		t.Errorf("default OpenPeriod(0) = %v, want 4s", got)
	}

	// Each trip draws its own period within OpenTimeout ± 20 %.
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: time.Hour}, nil)
	seen := map[time.Duration]bool{}
	for i := range 20 {
		b := set.Get(fmt.Sprint("t", i))
		if err := call(t.Context(), b, errUnavailable); err != nil {
			t.Fatal(err)
		}
		err := call(t.Context(), b, nil)
		wantOpen(t, err, b.Target(), "open", 47*time.Minute, 72*time.Minute)
		oe, _ := breaker.Open(err)
		seen[oe.RetryAfter.Round(time.Second)] = true
	}
	if len(seen) < 10 {
		t.Errorf("20 trips drew %d distinct open periods, want them spread", len(seen))
	}
}

// trip opens b with one failure (ConsecutiveFailures 1).
func trip(t *testing.T, b *breaker.Breaker) {
	t.Helper()
	if err := call(t.Context(), b, errUnavailable); err != nil {
		t.Fatal(err)
	}
	if s := b.State(); s != breaker.StateOpen {
		t.Fatalf("state %s after a failure, want open", s)
	}
}

func TestHalfOpenSingleProbe(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := breaker.Config{ConsecutiveFailures: 1, OpenTimeout: 50 * time.Millisecond, Jitter: -1}
	set := breaker.NewSet(cfg, reg)
	for _, probeErr := range []error{nil, errUnavailable} {
		b := set.Get(fmt.Sprint("probe-", probeErr == nil))
		trip(t, b)
		start := time.Now()
		waitState(t, b, breaker.StateHalfOpen, 5*time.Second)
		if el := time.Since(start); el > 5*time.Second {
			t.Fatalf("half-open after %v", el)
		}
		if g := stateGauges(t, reg, b.Target()); g != [3]float64{0, 1, 0} {
			t.Errorf("%s: gauges = %v, want [0 1 0] (the timer flips them without calls)", b.Target(), g)
		}
		probe, err := b.Allow(t.Context())
		if err != nil {
			t.Fatalf("half-open refused the probe: %v", err)
		}
		// While the probe is in flight, every other caller is refused at once.
		var wg sync.WaitGroup
		refused := make(chan error, 16)
		for range 16 {
			wg.Go(func() {
				if done, err := b.Allow(t.Context()); err == nil {
					done(nil)
					refused <- nil
				} else {
					refused <- err
				}
			})
		}
		wg.Wait()
		close(refused)
		for err := range refused {
			if err == nil {
				t.Fatal("a second call went through while the probe was in flight")
			}
			wantOpen(t, err, b.Target(), "half-open", breaker.MinRetryDelay, breaker.MinRetryDelay)
		}
		probe(probeErr)
		probe(probeErr) // a second report is ignored
		want := breaker.StateClosed
		if probeErr != nil {
			want = breaker.StateOpen
		}
		if s := b.State(); s != want {
			t.Errorf("after the probe ended with %v: state %s, want %s", probeErr, s, want)
		}
		tr := func(from, to string) float64 {
			return metric(t, reg, "curfew_circuit_breaker_transitions_total", map[string]string{"target": b.Target(), "from": from, "to": to})
		}
		if probeErr == nil && (tr("closed", "open") != 1 || tr("open", "half-open") != 1 || tr("half-open", "closed") != 1 || tr("half-open", "open") != 0) {
			t.Errorf("transitions closed→open %v open→half-open %v half-open→closed %v half-open→open %v, want 1 1 1 0",
				tr("closed", "open"), tr("open", "half-open"), tr("half-open", "closed"), tr("half-open", "open"))
		}
		if probeErr != nil {
			if tr("half-open", "open") != 1 || tr("half-open", "closed") != 0 {
				t.Errorf("transitions half-open→open %v half-open→closed %v, want 1 0", tr("half-open", "open"), tr("half-open", "closed"))
			}
			// Reopened for a new period: half-open again later.
			waitState(t, b, breaker.StateHalfOpen, 5*time.Second)
		}
		if v := metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": b.Target(), "outcome": "rejected"}); v != 16 {
			t.Errorf("rejected = %v, want 16", v)
		}
	}
}

func TestIgnoredProbeFreesTheSlot(t *testing.T) {
	b := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: 20 * time.Millisecond, Jitter: -1}, nil).Get("m")
	trip(t, b)
	waitState(t, b, breaker.StateHalfOpen, 5*time.Second)
	ctx, cancel := context.WithCancel(t.Context())
	probe, err := b.Allow(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	probe(status.Error(codes.Canceled, "caller went away"))
	if s := b.State(); s != breaker.StateHalfOpen {
		t.Fatalf("state %s after a cancelled probe, want still half-open", s)
	}
	next, err := b.Allow(t.Context())
	if err != nil {
		t.Fatalf("the slot of a cancelled probe was not freed: %v", err)
	}
	next(nil)
	if s := b.State(); s != breaker.StateClosed {
		t.Errorf("state %s after the second probe succeeded, want closed", s)
	}
}

func TestOutcomeOfAnEarlierStateIsDropped(t *testing.T) {
	b := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: 20 * time.Millisecond, Jitter: -1}, nil).Get("m")
	slow, err := b.Allow(t.Context()) // allowed while closed
	if err != nil {
		t.Fatal(err)
	}
	trip(t, b)
	waitState(t, b, breaker.StateHalfOpen, 5*time.Second)
	slow(nil) // a success from before the trip says nothing about now
	if s := b.State(); s != breaker.StateHalfOpen {
		t.Errorf("state %s after a stale success, want half-open", s)
	}
}

func TestCallerGivingUpNeverTrips(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := breaker.NewSet(breaker.Config{ConsecutiveFailures: 2, MinRequests: 2, FailureRatio: 0.1}, reg).Get("m")
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	expired, cancel2 := context.WithDeadline(t.Context(), time.Now().Add(-time.Millisecond))
	defer cancel2()
	short, cancel3 := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel3()
	cases := []struct {
		ctx context.Context
		err error
	}{
		{cancelled, status.Error(codes.Canceled, "context canceled")},
		{cancelled, errUnavailable}, // the transport broke as the caller cancelled
		{cancelled, context.Canceled},
		{t.Context(), status.Error(codes.Canceled, "cancelled above")},
		{expired, status.Error(codes.DeadlineExceeded, "context deadline exceeded")},
		{expired, context.DeadlineExceeded},
		{short, status.Error(codes.DeadlineExceeded, "deadline passed at the server")},
		{t.Context(), status.Error(codes.DeadlineExceeded, "no time left to start tool sleep: 3ms left, needs 10ms")},
		{t.Context(), errBadArg},
		{t.Context(), status.Error(codes.NotFound, "no such run")},
		{t.Context(), status.Error(codes.PermissionDenied, "no")},
		{t.Context(), status.Error(codes.Unauthenticated, "who")},
		{t.Context(), status.Error(codes.FailedPrecondition, "not now")},
		{t.Context(), status.Error(codes.AlreadyExists, "dup")},
		{t.Context(), status.Error(codes.OutOfRange, "past end")},
		{t.Context(), status.Error(codes.Aborted, "superseded by a newer attempt")},
		{t.Context(), status.Error(codes.Unimplemented, "no such method")},
	}
	var wg sync.WaitGroup
	for range 50 {
		for _, c := range cases {
			wg.Go(func() {
				if err := call(c.ctx, b, c.err); err != nil {
					t.Errorf("refused: %v", err)
				}
			})
		}
	}
	wg.Wait()
	if s := b.State(); s != breaker.StateClosed {
		t.Fatalf("state %s after %d calls that the callers gave up or were at fault, want closed", s, 50*len(cases))
	}
	if v := metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"outcome": "failure"}); v != 0 {
		t.Errorf("failures counted: %v", v)
	}
	if v := metric(t, reg, "curfew_circuit_breaker_transitions_total", nil); v != 0 {
		t.Errorf("transitions: %v", v)
	}
	// Two real failures still trip it.
	_ = call(t.Context(), b, errUnavailable)
	_ = call(t.Context(), b, errUnavailable)
	if s := b.State(); s != breaker.StateOpen {
		t.Errorf("state %s after 2 failures, want open", s)
	}
}

func TestOffNeverBreaks(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := breaker.NewSet(breaker.Config{Off: true, ConsecutiveFailures: 1}, reg).Get("m")
	for range 100 {
		if err := call(t.Context(), b, errUnavailable); err != nil {
			t.Fatalf("Off breaker refused: %v", err)
		}
	}
	if b.State() != breaker.StateClosed {
		t.Error("Off breaker not closed")
	}
}

func TestSetsShareARegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: time.Hour}, reg)
	p := breaker.NewSet(breaker.Config{}, reg) // modelproxy's providers beside the service targets
	trip(t, a.Get("svc"))
	_ = p.Get("provider")
	if g := stateGauges(t, reg, "svc"); g != [3]float64{0, 0, 1} {
		t.Errorf("svc gauges %v", g)
	}
	if g := stateGauges(t, reg, "provider"); g != [3]float64{1, 0, 0} {
		t.Errorf("provider gauges %v", g)
	}
	if first, again := a.Get("svc"), a.Get("svc"); first != again {
		t.Error("Get returned two breakers for one target")
	}
}

func TestStaysOpenForTheDrawnPeriod(t *testing.T) {
	// OpenTimeout 2s ± 50 % with the highest draw: gobreaker's own timeout is the shortest
	// period, 1s; the drawn one is just under 3s.
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: 2 * time.Second, Jitter: 0.5}, nil)
	set.SetRand(func() float64 { return 0.999 })
	b := set.Get("m")
	tripped := time.Now()
	trip(t, b)
	time.Sleep(1500 * time.Millisecond)
	st := b.State()
	done, err := b.Allow(t.Context())
	el := time.Since(tripped)
	if el >= 2900*time.Millisecond {
		t.Skipf("the machine took %v to check a breaker it tripped at 0; cannot tell", el)
	}
	if st != breaker.StateOpen || err == nil {
		if done != nil {
			done(nil)
		}
		t.Fatalf("%v after the trip, past gobreaker's 1s but within the drawn ~3s: state %s, Allow error %v; want open and refused", el, st, err)
	}
	wantOpen(t, err, "m", "open", 2800*time.Millisecond-el, 3100*time.Millisecond-el)
	waitState(t, b, breaker.StateHalfOpen, 10*time.Second)
	if el := time.Since(tripped); el < 2990*time.Millisecond {
		t.Errorf("half-open %v after the trip, before the drawn period of ~2.998s", el)
	}
}

func TestHalfOpensWithoutTraffic(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: 50 * time.Millisecond, Jitter: -1}, reg).Get("idle")
	trip(t, b)
	// Nothing asks the breaker: only its timer can move the gauge.
	end := time.Now().Add(5 * time.Second)
	for stateGauges(t, reg, "idle") != [3]float64{0, 1, 0} {
		if time.Now().After(end) {
			t.Fatalf("gauges %v 5s after a 50ms open period, want [0 1 0]", stateGauges(t, reg, "idle"))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestStateName(t *testing.T) {
	for st, want := range map[breaker.State]string{breaker.StateClosed: "closed", breaker.StateHalfOpen: "half_open", breaker.StateOpen: "open"} {
		if got := st.Name(); got != want {
			t.Errorf("%v.Name() = %q, want %q", st, got, want)
		}
	}
}
