package retry_test

import (
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/retry"
)

func TestBudgetConfigDefaults(t *testing.T) {
	got := retry.BudgetConfig{}.WithDefaults()
	if got.Ratio != 0.2 || got.PerSecond != 10 || got.Window != 10*time.Second || got.Disabled {
		t.Fatalf("zero budget defaults to %+v", got)
	}
	// Setting one of ratio and per-second takes the other as given: 0 stays 0.
	if got := (retry.BudgetConfig{Ratio: 0.2}).WithDefaults(); got.PerSecond != 0 || got.Ratio != 0.2 {
		t.Errorf("{Ratio: 0.2} defaults to %+v, want no per-second floor", got)
	}
	if got := (retry.BudgetConfig{PerSecond: 3}).WithDefaults(); got.PerSecond != 3 || got.Ratio != 0 {
		t.Errorf("{PerSecond: 3} defaults to %+v, want ratio 0", got)
	}
	for _, c := range []retry.BudgetConfig{{}, {Ratio: 10}, {Ratio: 0.5, PerSecond: 100, Window: time.Minute}, {Disabled: true}} {
		if err := c.Validate(); err != nil {
			t.Errorf("Validate(%+v) = %v", c, err)
		}
	}
	for _, c := range []retry.BudgetConfig{{Ratio: -0.1}, {Ratio: 10.5}, {PerSecond: -1}, {Window: -time.Second}} {
		if err := c.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil, want an error", c)
		}
	}
}

// spend takes retries from b until it refuses (at most limit tries) and returns how many it
// allowed.
func spend(b *retry.Budget, limit int) int {
	n := 0
	for range limit {
		if !b.AllowRetry() {
			break
		}
		n++
	}
	return n
}

func TestBudgetRatio(t *testing.T) {
	for _, n := range []int{0, 1, 4, 5, 9, 10, 100, 1000} {
		clk := newClock()
		b := retry.NewBudget(retry.BudgetConfig{Ratio: 0.2}, clk.Now)
		for range n {
			b.Request()
		}
		got := spend(b, 10*n+10)
		want := int(math.Floor(0.2 * float64(n)))
		if got != want {
			t.Errorf("%d requests: %d retries allowed, want %d (20%%, no floor)", n, got, want)
		}
		if b.AllowRetry() {
			t.Errorf("%d requests: a retry allowed past the budget", n)
		}
	}
}

func TestBudgetFloor(t *testing.T) {
	clk := newClock()
	// No requests at all: the floor, per_second × window, still allows some retries.
	b := retry.NewBudget(retry.BudgetConfig{PerSecond: 2, Window: 5 * time.Second}, clk.Now)
	if got := spend(b, 100); got != 10 {
		t.Errorf("floor 2/s over 5s: %d retries, want 10", got)
	}
	// Defaults: 20 % of 50 requests plus 10/s × 10 s.
	d := retry.NewBudget(retry.BudgetConfig{}, clk.Now)
	for range 50 {
		d.Request()
	}
	if got := spend(d, 1000); got != 110 {
		t.Errorf("defaults with 50 requests: %d retries, want 110", got)
	}
}

func TestBudgetWindowSlides(t *testing.T) {
	clk := newClock()
	b := retry.NewBudget(retry.BudgetConfig{Ratio: 0.2, Window: 10 * time.Second}, clk.Now)
	for range 50 {
		b.Request()
	}
	if got := spend(b, 100); got != 10 {
		t.Fatalf("t=0s: %d retries, want 10", got)
	}
	clk.Advance(5 * time.Second)
	for range 50 {
		b.Request()
	}
	// 100 requests and 10 retries in the window: 10 more.
	if got := spend(b, 100); got != 10 {
		t.Fatalf("t=5s: %d retries, want 10", got)
	}
	clk.Advance(4 * time.Second)
	if b.AllowRetry() {
		t.Fatal("t=9s: the t=0s requests still count, but so do 20 retries: want none")
	}
	// At t=10s the t=0s second ages out: 50 requests and 10 retries remain.
	clk.Advance(time.Second)
	if b.AllowRetry() {
		t.Fatal("t=10s: 50 requests allow 10 retries, all spent at t=5s: want none")
	}
	// At t=15s everything aged out: no requests, no floor, no retries.
	clk.Advance(5 * time.Second)
	if b.AllowRetry() {
		t.Fatal("t=15s: retry allowed with an empty window and no floor")
	}
	for range 10 {
		b.Request()
	}
	if got := spend(b, 100); got != 2 {
		t.Fatalf("t=15s after 10 new requests: %d retries, want 2", got)
	}
	// A jump far ahead (beyond any bucket reuse) forgets it all too.
	clk.Advance(time.Hour)
	if b.AllowRetry() {
		t.Fatal("an hour later: retry allowed with an empty window")
	}
}

func TestBudgetSubSecondWindow(t *testing.T) {
	clk := newClock()
	b := retry.NewBudget(retry.BudgetConfig{Ratio: 1, Window: 100 * time.Millisecond}, clk.Now)
	b.Request()
	if !b.AllowRetry() || b.AllowRetry() {
		t.Fatal("ratio 1 with one request: want exactly one retry")
	}
	clk.Advance(time.Second)
	if b.AllowRetry() {
		t.Fatal("a second later the window (one bucket) still holds the request")
	}
}

func TestBudgetDisabledAlwaysAllows(t *testing.T) {
	b := retry.NewBudget(retry.BudgetConfig{Disabled: true, Ratio: 0.01}, newClock().Now)
	for i := range 10000 {
		if !b.AllowRetry() {
			t.Fatalf("disabled budget refused retry %d", i)
		}
	}
}

func TestBudgetConcurrent(t *testing.T) {
	clk := newClock()
	b := retry.NewBudget(retry.BudgetConfig{Ratio: 0.2}, clk.Now)
	var allowed atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 250 {
				b.Request()
			}
			for range 250 {
				if b.AllowRetry() {
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	// Requests and retries interleave, so fewer may pass early, but never more than 20 % of
	// the 2000 requests.
	if got := allowed.Load(); got > 400 || got == 0 {
		t.Fatalf("%d retries allowed concurrently, want in (0, 400]", got)
	}
	if got := allowed.Load() + int64(spend(b, 1000)); got != 400 {
		t.Fatalf("after all requests: %d retries in total, want 400", got)
	}
}

func TestThrottleWithoutAccepts(t *testing.T) {
	// After N requests and no accepts the next is rejected with probability N/(N+1).
	prev := 0.0
	for _, n := range []int{0, 1, 9, 99, 999} {
		p := float64(n) / float64(n+1)
		below, at := retry.NewThrottle(0, 0, newClock().Now), retry.NewThrottle(0, 0, newClock().Now)
		for range n {
			below.Allow(0)
			at.Allow(0)
		}
		if n > 0 && below.Allow(p-1e-9) {
			t.Errorf("%d requests: rnd just below %.4f allowed, want rejected", n, p)
		}
		if !at.Allow(p) {
			t.Errorf("%d requests: rnd %.4f rejected, want allowed (rnd ≥ p)", n, p)
		}
		if p < prev {
			t.Fatalf("rejection probability fell: %v after %v", p, prev)
		}
		prev = p
	}
	if prev < 0.999 {
		t.Fatalf("rejection probability %v after 999 requests, want → 1", prev)
	}
	// Sampling confirms it: after 1000 failing requests nearly every further one is rejected.
	th := retry.NewThrottle(0, 0, newClock().Now)
	for range 1000 {
		th.Allow(0.5)
	}
	rejected := 0
	for i := range 1000 {
		if !th.Allow((float64(i) + 0.5) / 1000) {
			rejected++
		}
	}
	if rejected < 995 {
		t.Fatalf("%d of 1000 rejected after 1000 unanswered requests, want nearly all", rejected)
	}
}

func TestThrottleWithAccepts(t *testing.T) {
	th := retry.NewThrottle(0, 0, newClock().Now)
	for i := range 1000 {
		if !th.Allow(0) {
			t.Fatalf("request %d rejected although every request was accepted", i)
		}
		th.Accepted()
	}
	// Half accepted: requests − 2·accepts ≤ 0, nothing rejected.
	half := retry.NewThrottle(0, 0, newClock().Now)
	for i := range 1000 {
		if !half.Allow(0) {
			t.Fatalf("request %d rejected with half accepted", i)
		}
		if i%2 == 0 {
			half.Accepted()
		}
	}
	// 10 requests, 3 accepts: p = (10 − 6)/11.
	mix := retry.NewThrottle(0, 0, newClock().Now)
	for range 10 {
		mix.Allow(0)
	}
	for range 3 {
		mix.Accepted()
	}
	if mix.Allow(4.0/11 - 1e-9) {
		t.Error("rnd below (10−2·3)/11 allowed")
	}
	mix2 := retry.NewThrottle(2, time.Minute, newClock().Now)
	for range 10 {
		mix2.Allow(0)
	}
	for range 3 {
		mix2.Accepted()
	}
	if !mix2.Allow(4.0 / 11) {
		t.Error("rnd at (10−2·3)/11 rejected")
	}
}

func TestThrottleForgets(t *testing.T) {
	clk := newClock()
	th := retry.NewThrottle(0, 10*time.Second, clk.Now)
	for range 100 {
		th.Allow(0)
	}
	if th.Allow(0.9) {
		t.Fatal("rnd 0.9 allowed after 100 unanswered requests")
	}
	clk.Advance(10 * time.Second)
	if !th.Allow(0) {
		t.Fatal("requests a window ago still throttle")
	}
}

func TestThrottleK(t *testing.T) {
	// K = 1: 10 requests, 5 accepts → p = 5/11.
	th := retry.NewThrottle(1, 0, newClock().Now)
	for range 10 {
		th.Allow(0)
	}
	for range 5 {
		th.Accepted()
	}
	if th.Allow(5.0/11 - 1e-9) {
		t.Fatal("K=1: rnd below 5/11 allowed")
	}
}
