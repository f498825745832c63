package retrywindow

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func newHolder(t *testing.T, st store.Slots, name string, n int, length time.Duration, reg prometheus.Registerer) *Holder {
	t.Helper()
	h, err := New(Config{Store: st, Name: name, Window: retry.WindowConfig{Replicas: n, Length: length}, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close(context.Background()) })
	return h
}

// window is one window as its retries saw it: from the first retry it allowed to the
// last.
type window struct {
	holder      string
	epoch       int64
	slot        int
	first, last time.Time
}

// race runs callers on every holder, each asking for target's window in a loop (a
// retry every few milliseconds, as under a failing dependency), for d; it returns the
// windows seen and the number of refusals.
func race(t *testing.T, hs []*Holder, target string, d time.Duration) ([]window, int64) {
	t.Helper()
	var mu sync.Mutex
	wins := map[string]*window{}
	var refused atomic.Int64
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for _, h := range hs {
		for range 3 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(end) {
					// allow names the window that allowed the retry at the moment it
					// decided; asking Status afterwards would race the window's end.
					sl, err := h.allow(context.Background(), target)
					now := time.Now()
					switch {
					case err == nil:
						if sl.Holder != h.Name() || sl.Epoch == 0 {
							t.Errorf("%s: allowed without a window of its own: %+v", h.Name(), sl)
							return
						}
						k := fmt.Sprintf("%s/%d/%d", h.Name(), sl.N, sl.Epoch)
						mu.Lock()
						w := wins[k]
						if w == nil {
							w = &window{holder: h.Name(), epoch: sl.Epoch, slot: sl.N, first: now}
							wins[k] = w
						}
						w.last = now
						mu.Unlock()
					case errors.Is(err, ErrBusy):
						refused.Add(1)
					default:
						t.Errorf("%s: %v", h.Name(), err)
						return
					}
					time.Sleep(3 * time.Millisecond)
				}
			}()
		}
	}
	wg.Wait()
	out := make([]window, 0, len(wins))
	for _, w := range wins {
		out = append(out, *w)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].first.Before(out[j].first) })
	return out, refused.Load()
}

// maxOverlap is the most windows whose retries overlapped at any moment.
func maxOverlap(ws []window) int {
	type ev struct {
		at    time.Time
		delta int
	}
	var evs []ev
	for _, w := range ws {
		evs = append(evs, ev{w.first, 1}, ev{w.last, -1})
	}
	sort.Slice(evs, func(i, j int) bool {
		if evs[i].at.Equal(evs[j].at) {
			return evs[i].delta > evs[j].delta // touching counts as overlapping
		}
		return evs[i].at.Before(evs[j].at)
	})
	n, peak := 0, 0
	for _, e := range evs {
		n += e.delta
		peak = max(peak, n)
	}
	return peak
}

// checkRace races holders for d and checks that at most n windows ever overlapped,
// that the others were refused, and that the windows moved between holders.
func checkRace(t *testing.T, hs []*Holder, n int, length, d time.Duration) {
	t.Helper()
	ws, refused := race(t, hs, "toolrunner", d)
	peak := maxOverlap(ws)
	holders := map[string]bool{}
	for _, w := range ws {
		holders[w.holder] = true
		if got := w.last.Sub(w.first); got > length {
			t.Errorf("window %+v used for %v, longer than its length %v", w, got, length)
		}
	}
	t.Logf("%d windows over %v on %d holders (%d distinct), peak overlap %d (n %d), %d refusals",
		len(ws), d, len(hs), len(holders), peak, n, refused)
	if peak > n {
		t.Fatalf("%d windows overlapped, at most %d allowed: %+v", peak, n, ws)
	}
	if refused == 0 {
		t.Fatal("no retry was refused")
	}
	// d spans several lengths: the window moved, and at least once to another holder.
	if len(ws) < 3 || len(holders) < 2 {
		t.Fatalf("windows did not move between holders: %+v", ws)
	}
}

// TestAtMostNWindowsMemory: four replicas (holders) sharing one store race retries
// against one target; at no moment do more than N of them retry, the others are
// refused, and the window moves after its length.
func TestAtMostNWindowsMemory(t *testing.T) {
	st := storetest.OpenMemory(t)
	for _, n := range []int{1, 2} {
		t.Run(fmt.Sprint("n", n), func(t *testing.T) {
			length := 400 * time.Millisecond
			var hs []*Holder
			for i := range 4 {
				hs = append(hs, newHolder(t, st, fmt.Sprintf("n%d-r%d", n, i), n, length, nil))
			}
			if n == 2 {
				// The scope was sized 1 by the first subtest's holders: a new size is
				// applied by the first claim of each new holder (last writer wins).
				if err := st.SizeSlots(context.Background(), Scope("toolrunner"), 2); err != nil {
					t.Fatal(err)
				}
			}
			checkRace(t, hs, n, length, 6*length)
		})
	}
}

// TestAtMostNWindowsPostgres: the same with each replica on a store handle of its own
// (a process each) on PostgreSQL.
func TestAtMostNWindowsPostgres(t *testing.T) {
	dsn := storetest.PostgresDSN(t)
	length := 500 * time.Millisecond
	var hs []*Holder
	for i := range 3 {
		s, err := store.Open(context.Background(), dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		hs = append(hs, newHolder(t, s, fmt.Sprintf("r%d", i), 1, length, nil))
	}
	checkRace(t, hs, 1, length, 6*length)
}

// TestFirstRetryClaimsAndHolds: the first retry claims the window (1 claim), the next
// ones make no round trip; the metrics say so.
func TestFirstRetryClaimsAndHolds(t *testing.T) {
	st := &counting{Slots: storetest.OpenMemory(t)}
	reg := prometheus.NewRegistry()
	a := newHolder(t, st, "a", 1, 10*time.Second, reg)
	b := newHolder(t, st, "b", 1, 10*time.Second, nil)
	a.Known("toolrunner")
	for range 50 {
		if err := a.AllowRetry(context.Background(), "toolrunner"); err != nil {
			t.Fatal(err)
		}
	}
	if got := st.claims.Load(); got != 1 {
		t.Fatalf("%d claims for 50 retries in one window, want 1", got)
	}
	for range 50 {
		if err := b.AllowRetry(context.Background(), "toolrunner"); !errors.Is(err, ErrBusy) {
			t.Fatalf("b: %v, want ErrBusy", err)
		}
	}
	if got := st.claims.Load(); got != 2 {
		t.Fatalf("%d claims after b's 50 refusals, want 2 (b asks once, then waits for the window to move)", got)
	}
	if v := testutil.ToFloat64(a.metrics.heldG.WithLabelValues("toolrunner")); v != 1 {
		t.Fatalf("held gauge %v", v)
	}
	if v := testutil.ToFloat64(b.metrics.refusedC.WithLabelValues("toolrunner", "busy")); v != 50 {
		t.Fatalf("refused %v, want 50", v)
	}
	// Close releases a's window: b may claim it as soon as its refusal runs out (here:
	// the store said the window moves in 10 s, so b still waits; a new replica does not).
	if err := a.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	c := newHolder(t, st, "c", 1, 10*time.Second, nil)
	if err := c.AllowRetry(context.Background(), "toolrunner"); err != nil {
		t.Fatalf("c after a's close: %v", err)
	}
	if err := a.AllowRetry(context.Background(), "toolrunner"); !errors.Is(err, ErrClosed) {
		t.Fatalf("a after close: %v", err)
	}
}

// TestLostWindowEndsAtOnce: a window whose slot changed hands in the store (an
// expiry by a skewed clock, an operator) ends at the next verification, and the
// replica stops retrying at once.
func TestLostWindowEndsAtOnce(t *testing.T) {
	st := storetest.OpenMemory(t)
	a := newHolder(t, st, "a", 1, 900*time.Millisecond, nil)
	if err := a.AllowRetry(context.Background(), "toolrunner"); err != nil {
		t.Fatal(err)
	}
	s := a.Status()["toolrunner"]
	// Someone else takes the slot: free it under a's epoch, claim it as "b".
	if err := st.ReleaseSlot(context.Background(), store.Slot{Scope: Scope("toolrunner"), N: s.Slot, Holder: "a", Epoch: s.Epoch}); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := st.ClaimSlot(context.Background(), Scope("toolrunner"), "b", time.Minute); !ok || err != nil {
		t.Fatal(ok, err)
	}
	time.Sleep(a.verify + 10*time.Millisecond)
	if err := a.AllowRetry(context.Background(), "toolrunner"); !errors.Is(err, ErrBusy) {
		t.Fatalf("after the window was taken: %v, want ErrBusy", err)
	}
	if a.Status()["toolrunner"].Held {
		t.Fatal("still held")
	}
	if v := testutil.ToFloat64(a.metrics.lostC.WithLabelValues("toolrunner", "taken")); v != 1 {
		t.Fatalf("lost %v", v)
	}
}

// TestStoreDownRefusesThenResumes: while the store fails, retries that need a window
// are refused at once (ErrStoreDown, counted as store_down), a held window whose
// verification fails ends, and the first claim that succeeds afterwards resumes
// coordination.
func TestStoreDownRefusesThenResumes(t *testing.T) {
	st := &failing{Slots: storetest.OpenMemory(t)}
	a := newHolder(t, st, "a", 1, 600*time.Millisecond, nil)
	b := newHolder(t, st, "b", 1, 600*time.Millisecond, nil)
	if err := a.AllowRetry(context.Background(), "toolrunner"); err != nil {
		t.Fatal(err)
	}
	st.down.Store(true)
	start := time.Now()
	for range 20 {
		if err := b.AllowRetry(context.Background(), "toolrunner"); !errors.Is(err, ErrStoreDown) {
			t.Fatalf("b with the store down: %v", err)
		}
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("refusals took %v: not fast", d)
	}
	if got := st.calls.Load(); got != 1 {
		t.Fatalf("%d store calls for 20 refusals while down, want 1: the others are refused locally", got)
	}
	if v := testutil.ToFloat64(b.metrics.refusedC.WithLabelValues("toolrunner", "store_down")); v != 20 {
		t.Fatalf("store_down refusals %v, want 20", v)
	}
	if s := b.Status()["toolrunner"]; !s.StoreDown || s.Refused != 20 || s.DownSince.Before(start) || s.DownSince.After(time.Now()) {
		t.Fatalf("b's status %+v, want the store down since the first refusal and 20 refused", s)
	}
	// a's window: its next verification fails and ends it.
	time.Sleep(a.verify + 10*time.Millisecond)
	if err := a.AllowRetry(context.Background(), "toolrunner"); !errors.Is(err, ErrStoreDown) {
		t.Fatalf("a with the store down: %v", err)
	}
	if v := testutil.ToFloat64(a.metrics.lostC.WithLabelValues("toolrunner", "verify_failed")); v != 1 {
		t.Fatalf("lost %v", v)
	}
	// The store answers again: after StoreRetry, one of them claims the window (a's old
	// slot has expired by then or is claimable once it does), and the other is refused.
	st.down.Store(false)
	deadline := time.Now().Add(5 * time.Second)
	var other *Holder
	for other == nil {
		ea, eb := a.AllowRetry(context.Background(), "toolrunner"), b.AllowRetry(context.Background(), "toolrunner")
		switch {
		case ea == nil && eb == nil:
			t.Fatal("both hold a window")
		case ea == nil:
			other = b
		case eb == nil:
			other = a
		case time.Now().After(deadline):
			t.Fatalf("coordination did not resume: %v, %v", ea, eb)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if s := other.Status()["toolrunner"]; s.Held || (other == b && s.Refused < 20) {
		t.Fatalf("%s's status %+v, want no window held and its refusals counted", other.Name(), s)
	}
	// The other one's refusal turns from store_down to busy once it asks the store.
	for {
		err := other.AllowRetry(context.Background(), "toolrunner")
		if errors.Is(err, ErrBusy) {
			break
		}
		if err == nil || !errors.Is(err, ErrStoreDown) || time.Now().After(deadline) {
			t.Fatalf("%s after the store came back: %v, want ErrBusy", other.Name(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// counting counts claims.
type counting struct {
	store.Slots
	claims atomic.Int64
}

func (c *counting) ClaimSlot(ctx context.Context, scope, holder string, ttl time.Duration) (store.Slot, bool, error) {
	c.claims.Add(1)
	return c.Slots.ClaimSlot(ctx, scope, holder, ttl)
}

// failing fails every slot operation while down.
type failing struct {
	store.Slots
	down  atomic.Bool
	calls atomic.Int64
}

var errDown = errors.New("store down")

func (f *failing) SizeSlots(ctx context.Context, scope string, n int) error {
	if f.down.Load() {
		f.calls.Add(1)
		return errDown
	}
	return f.Slots.SizeSlots(ctx, scope, n)
}

func (f *failing) ClaimSlot(ctx context.Context, scope, holder string, ttl time.Duration) (store.Slot, bool, error) {
	if f.down.Load() {
		f.calls.Add(1)
		return store.Slot{}, false, errDown
	}
	return f.Slots.ClaimSlot(ctx, scope, holder, ttl)
}

func (f *failing) ListSlots(ctx context.Context, scope string) ([]store.Slot, error) {
	if f.down.Load() {
		f.calls.Add(1)
		return nil, errDown
	}
	return f.Slots.ListSlots(ctx, scope)
}

// TestCancelledCallIsNotAnOutage: a call whose context ends while it claims is refused
// with its own error, and the store is not taken for down.
func TestCancelledCallIsNotAnOutage(t *testing.T) {
	st := storetest.OpenMemory(t)
	a := newHolder(t, st, "a", 1, 10*time.Second, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := a.AllowRetry(ctx, "toolrunner"); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled call: %v", err)
	}
	if err := a.AllowRetry(context.Background(), "toolrunner"); err != nil {
		t.Fatalf("the next call: %v, want the window", err)
	}
}
