package clusterslots

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newHolder starts a Holder on st, closed when the test ends.
func newHolder(t *testing.T, st store.Slots, name string, ttl, poll time.Duration) *Holder {
	t.Helper()
	h, err := New(Config{Store: st, Name: name, TTL: ttl, Poll: poll})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close(context.Background()) })
	return h
}

// kill stops h's loops without releasing anything: a process that died.
func kill(h *Holder) {
	h.mu.Lock()
	h.closed = true
	h.mu.Unlock()
	h.stop()
	h.wg.Wait()
}

// waitFor polls cond until it holds or d passes.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(d); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func size(t *testing.T, h *Holder, scope string, n int) {
	t.Helper()
	if err := h.Size(context.Background(), scope, n); err != nil {
		t.Fatal(err)
	}
}

func acquire(t *testing.T, h *Holder, scope string) *Slot {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := h.Acquire(ctx, scope)
	if err != nil {
		t.Fatalf("acquire %s: %v", scope, err)
	}
	return s
}

func TestAcquireWaitRelease(t *testing.T) {
	st := storetest.OpenMemory(t)
	h := newHolder(t, st, "a", time.Minute, time.Hour) // a local release must wake, not the poll
	size(t, h, "pool/paid", 2)
	s1, s2 := acquire(t, h, "pool/paid"), acquire(t, h, "pool/paid")
	if _, ok, err := h.TryAcquire(context.Background(), "pool/paid"); ok || err != nil {
		t.Fatalf("try with both held: %v %v", ok, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := h.Acquire(ctx, "pool/paid"); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("acquire with both held: %v", err)
	}
	got := make(chan *Slot)
	go func() { got <- acquire(t, h, "pool/paid") }()
	waitFor(t, 5*time.Second, "a waiter", func() bool { return h.Status().Waiting["pool/paid"] == 1 })
	if err := s1.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := s1.Release(context.Background()); err != nil {
		t.Fatalf("second release: %v", err)
	}
	var s3 *Slot
	select {
	case s3 = <-got:
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter was not served after a local release")
	}
	if i := s3.Info(); i.N != 0 || i.Epoch != 2 || s3.Err() != nil {
		t.Fatalf("served %+v, %v", i, s3.Err())
	}
	if st := h.Status(); st.Held["pool/paid"] != 2 || len(st.Waiting) != 0 || st.Notified {
		t.Fatalf("status %+v", st)
	}
	_ = s2.Release(context.Background())
	_ = s3.Release(context.Background())
}

// TestFIFO: a scope's local waiters are served in arrival order.
func TestFIFO(t *testing.T) {
	st := storetest.OpenMemory(t)
	h := newHolder(t, st, "a", time.Minute, time.Hour)
	size(t, h, "tenant/acme", 1)
	cur := acquire(t, h, "tenant/acme")
	order := make(chan int, 3)
	slots := make(chan *Slot, 3)
	for i := range 3 {
		go func() {
			s := acquire(t, h, "tenant/acme")
			order <- i
			slots <- s
		}()
		waitFor(t, 5*time.Second, "waiter", func() bool { return h.Status().Waiting["tenant/acme"] == i+1 })
	}
	for want := range 3 {
		if err := cur.Release(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := <-order; got != want {
			t.Fatalf("served waiter %d, want %d", got, want)
		}
		cur = <-slots
	}
	_ = cur.Release(context.Background())
}

// TestCapAcrossHolders: 64 callers on two holders (two replicas) against a scope of 2
// never hold more than 2 at once, and each gets its turn.
func TestCapAcrossHolders(t *testing.T) {
	st := storetest.OpenMemory(t)
	hs := []*Holder{newHolder(t, st, "a", time.Minute, 5*time.Millisecond), newHolder(t, st, "b", time.Minute, 5*time.Millisecond)}
	size(t, hs[0], "pool/paid", 2)
	var held, peak, done atomic.Int64
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			s, err := hs[i%2].Acquire(ctx, "pool/paid")
			if err != nil {
				t.Error(err)
				return
			}
			n := held.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			time.Sleep(time.Millisecond)
			held.Add(-1)
			done.Add(1)
			if err := s.Release(context.Background()); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if p := peak.Load(); p > 2 {
		t.Fatalf("peak %d held, cap 2", p)
	}
	if d := done.Load(); d != 64 {
		t.Fatalf("%d of 64 served", d)
	}
}

// TestKilledHolderSlotsReturn: renewals keep a holder's slots past their TTL; once it
// stops renewing without releasing (SIGKILL), another holder's waiters get them within
// TTL + 1 s.
func TestKilledHolderSlotsReturn(t *testing.T) {
	const ttl = time.Second
	st := storetest.OpenMemory(t)
	a := newHolder(t, st, "a", ttl, DefaultPoll)
	b := newHolder(t, st, "b", ttl, DefaultPoll)
	size(t, a, "pool/paid", 2)
	acquire(t, a, "pool/paid")
	acquire(t, a, "pool/paid")
	got := make(chan *Slot, 2)
	for range 2 {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			s, err := b.Acquire(ctx, "pool/paid")
			if err != nil {
				t.Error(err)
			}
			got <- s
		}()
	}
	// Past two TTLs, a still holds both: its renewals work.
	select {
	case <-got:
		t.Fatal("b got a slot while a was renewing")
	case <-time.After(2*ttl + ttl/2):
	}
	if st := a.Status(); st.Held["pool/paid"] != 2 || st.RenewError != nil || st.LastRenew.IsZero() {
		t.Fatalf("a's status %+v", st)
	}
	kill(a)
	killed := time.Now()
	for range 2 {
		if s := <-got; s == nil {
			t.FailNow()
		}
	}
	if d := time.Since(killed); d > ttl+time.Second {
		t.Fatalf("the killed holder's slots came back after %v, want within %v", d, ttl+time.Second)
	}
}

// TestLostToAnotherHolder: a renewal without the slot (it expired and was claimed by
// someone else) marks it lost with ErrLost, and its release frees nothing.
func TestLostToAnotherHolder(t *testing.T) {
	clock := storetest.NewClock()
	st := storetest.OpenMemory(t, store.WithClock(clock.Now))
	h := newHolder(t, st, "a", time.Minute, time.Hour)
	size(t, h, "pool/paid", 1)
	s := acquire(t, h, "pool/paid")
	clock.Advance(2 * time.Minute) // the store sees it expired
	other, ok, err := st.ClaimSlot(context.Background(), "pool/paid", "b", time.Minute)
	if err != nil || !ok {
		t.Fatalf("b's claim: %v %v", ok, err)
	}
	h.renewOnce()
	select {
	case <-s.Lost():
	default:
		t.Fatal("not lost")
	}
	if !errors.Is(s.Err(), ErrLost) {
		t.Fatalf("err %v", s.Err())
	}
	if err := s.Release(context.Background()); err != nil {
		t.Fatalf("release of a lost slot: %v", err)
	}
	got, _ := st.ListSlots(context.Background(), "pool/paid")
	if len(got) != 1 || got[0].Holder != "b" || got[0].Epoch != other.Epoch {
		t.Fatalf("b's slot after a's release: %+v", got)
	}
	if n := h.Status().Held["pool/paid"]; n != 0 {
		t.Fatalf("still counted as held: %d", n)
	}
}

// failing wraps a store and fails the operations switched on.
type failing struct {
	store.Slots
	renew, claim, release atomic.Bool
}

func (f *failing) ReleaseSlot(ctx context.Context, s store.Slot) error {
	if f.release.Load() {
		return errDown
	}
	return f.Slots.ReleaseSlot(ctx, s)
}

func (f *failing) ReleaseSlots(ctx context.Context, ss []store.Slot) (int, error) {
	if f.release.Load() {
		return 0, errDown
	}
	return f.Slots.ReleaseSlots(ctx, ss)
}

var errDown = errors.New("store down")

func (f *failing) RenewSlots(ctx context.Context, holder string, ttl time.Duration) ([]store.Slot, error) {
	if f.renew.Load() {
		return nil, errDown
	}
	return f.Slots.RenewSlots(ctx, holder, ttl)
}

func (f *failing) ClaimSlot(ctx context.Context, scope, holder string, ttl time.Duration) (store.Slot, bool, error) {
	if f.claim.Load() {
		return store.Slot{}, false, errDown
	}
	return f.Slots.ClaimSlot(ctx, scope, holder, ttl)
}

// TestRenewFailures: failed renewals are reported at once (Status, OnRenewError), and
// past the TTL the slot is lost with ErrRenewFailed; a later release still frees it.
func TestRenewFailures(t *testing.T) {
	st := &failing{Slots: storetest.OpenMemory(t)}
	var reported atomic.Int64
	h, err := New(Config{Store: st, Name: "a", TTL: 300 * time.Millisecond, Poll: time.Hour,
		OnRenewError: func(err error) {
			if errors.Is(err, errDown) {
				reported.Add(1)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = h.Close(context.Background()) }()
	size(t, h, "pool/paid", 1)
	s := acquire(t, h, "pool/paid")
	st.renew.Store(true)
	select {
	case <-s.Lost():
	case <-time.After(10 * time.Second):
		t.Fatal("not lost after failed renewals")
	}
	if !errors.Is(s.Err(), ErrRenewFailed) || !errors.Is(s.Err(), errDown) {
		t.Fatalf("err %v", s.Err())
	}
	if reported.Load() == 0 || !errors.Is(h.Status().RenewError, errDown) {
		t.Fatalf("renew errors not reported: %d, %v", reported.Load(), h.Status().RenewError)
	}
	st.renew.Store(false)
	if err := s.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := h.TryAcquire(context.Background(), "pool/paid"); !ok || err != nil {
		t.Fatalf("after the release of the lost slot: %v %v", ok, err)
	}
}

// TestFailedReleaseRetried: a slot whose release failed (the store down) is released
// again before the next renewal, which would otherwise keep it held with the holder's
// other slots for as long as the process lives.
func TestFailedReleaseRetried(t *testing.T) {
	st := &failing{Slots: storetest.OpenMemory(t)}
	h := newHolder(t, st, "a", 300*time.Millisecond, time.Hour)
	size(t, h, "pool/paid", 2)
	kept := acquire(t, h, "pool/paid")
	gone := acquire(t, h, "pool/paid")
	st.release.Store(true)
	if err := gone.Release(context.Background()); !errors.Is(err, errDown) {
		t.Fatalf("release while the store is down: %v", err)
	}
	st.release.Store(false)
	n := gone.Info().N
	waitFor(t, 5*time.Second, "the failed release retried", func() bool {
		slots, err := st.ListSlots(context.Background(), "pool/paid")
		return err == nil && slots[n].Holder == ""
	})
	time.Sleep(400 * time.Millisecond) // more than a TTL of renewals
	slots, err := st.ListSlots(context.Background(), "pool/paid")
	if err != nil {
		t.Fatal(err)
	}
	if slots[n].Holder != "" || !slots[kept.Info().N].Held(time.Now()) {
		t.Fatalf("after the retry: %+v, want slot %d free and slot %d still held", slots, n, kept.Info().N)
	}
	select {
	case <-kept.Lost():
		t.Fatalf("the kept slot was lost: %v", kept.Err())
	default:
	}
}

// TestClaimErrorEndsWaits: a store error while waiting ends every wait of the scope
// with it; the caller decides on the degraded mode.
func TestClaimErrorEndsWaits(t *testing.T) {
	st := &failing{Slots: storetest.OpenMemory(t)}
	h := newHolder(t, st, "a", time.Minute, 10*time.Millisecond)
	size(t, h, "pool/paid", 1)
	s := acquire(t, h, "pool/paid")
	errs := make(chan error, 2)
	for range 2 {
		go func() {
			_, err := h.Acquire(context.Background(), "pool/paid")
			errs <- err
		}()
	}
	waitFor(t, 5*time.Second, "two waiters", func() bool { return h.Status().Waiting["pool/paid"] == 2 })
	st.claim.Store(true)
	for range 2 {
		if err := <-errs; !errors.Is(err, errDown) {
			t.Fatalf("wait ended with %v, want the store's error", err)
		}
	}
	_ = s.Release(context.Background())
}

// TestCloseReleases: Close ends waits with ErrClosed and frees the held slots at once.
func TestCloseReleases(t *testing.T) {
	st := storetest.OpenMemory(t)
	h, err := New(Config{Store: st, Name: "a", TTL: time.Minute, Poll: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	size(t, h, "pool/paid", 1)
	s := acquire(t, h, "pool/paid")
	errc := make(chan error, 1)
	go func() {
		_, err := h.Acquire(context.Background(), "pool/paid")
		errc <- err
	}()
	waitFor(t, 5*time.Second, "a waiter", func() bool { return h.Status().Waiting["pool/paid"] == 1 })
	if err := h.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; !errors.Is(err, ErrClosed) {
		t.Fatalf("wait ended with %v", err)
	}
	if err := s.Release(context.Background()); err != nil {
		t.Fatalf("release after close: %v", err)
	}
	got, _ := st.ListSlots(context.Background(), "pool/paid")
	if len(got) != 1 || got[0].Holder != "" {
		t.Fatalf("after close: %+v", got)
	}
	if _, err := h.Acquire(context.Background(), "pool/paid"); !errors.Is(err, ErrClosed) {
		t.Fatalf("acquire after close: %v", err)
	}
}

// TestPostgresReleaseWakesOtherReplica: on PostgreSQL a release on one replica wakes a
// waiter on another at once (LISTEN/NOTIFY), long before its poll.
func TestPostgresReleaseWakesOtherReplica(t *testing.T) {
	dsn := storetest.PostgresDSN(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	open := func() store.Store {
		s, err := store.Open(ctx, dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close() })
		return s
	}
	sa, sb := open(), open()
	a := newHolder(t, sa, "a", 10*time.Second, time.Hour)
	released := make(chan string, 16)
	b, err := New(Config{Store: sb, Name: "b", TTL: 10 * time.Second, Poll: time.Hour, OnRelease: func(scope string) {
		if scope == "pool/wake" {
			released <- scope
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	waitFor(t, 10*time.Second, "b listening", func() bool { return b.Status().Notified })
	size(t, a, "pool/wake", 1)
	s := acquire(t, a, "pool/wake")
	got := make(chan *Slot, 1)
	go func() {
		s, err := b.Acquire(ctx, "pool/wake")
		if err != nil {
			t.Error(err)
		}
		got <- s
	}()
	waitFor(t, 5*time.Second, "b waiting", func() bool { return b.Status().Waiting["pool/wake"] == 1 })
	if err := s.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-got:
		if s == nil {
			t.FailNow()
		}
		_ = s.Release(ctx)
	case <-time.After(10 * time.Second):
		t.Fatal("b was not woken by a's release")
	}
	select {
	case <-released: // OnRelease heard of a's release too
	case <-time.After(10 * time.Second):
		t.Fatal("b's OnRelease was not called")
	}
	// The holders' cleanups run before the stores' (last in, first out): their Close
	// still has a store to release into.
}

// TestTryAcquireAll: a run's pool and tenant slots in one round trip each way, all or
// none, renewed like any other.
func TestTryAcquireAll(t *testing.T) {
	st := storetest.OpenMemory(t)
	var woken sync.Map
	h, err := New(Config{Store: st, Name: "a", TTL: 300 * time.Millisecond, Poll: time.Hour,
		OnRelease: func(scope string) { woken.Store(scope, true) }})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = h.Close(context.Background()) }()
	size(t, h, "pool/paid", 2)
	size(t, h, "tenant/acme", 1)
	ctx := context.Background()
	ss, ok, err := h.TryAcquireAll(ctx, "pool/paid", "tenant/acme")
	if err != nil || !ok || len(ss) != 2 || ss[0].Info().Scope != "pool/paid" || ss[1].Info().Scope != "tenant/acme" {
		t.Fatalf("acquire both: %v %v %v", ss, ok, err)
	}
	if _, ok, err := h.TryAcquireAll(ctx, "pool/paid", "tenant/acme"); ok || err != nil {
		t.Fatalf("with the tenant full: %v %v", ok, err)
	}
	time.Sleep(time.Second) // past three TTLs: renewals keep both
	if st := h.Status(); st.Held["pool/paid"] != 1 || st.Held["tenant/acme"] != 1 || st.RenewError != nil {
		t.Fatalf("status %+v", st)
	}
	for _, s := range ss {
		if s.Err() != nil {
			t.Fatalf("lost: %v", s.Err())
		}
	}
	if err := h.ReleaseAll(ctx, ss...); err != nil {
		t.Fatal(err)
	}
	if err := h.ReleaseAll(ctx, ss...); err != nil {
		t.Fatalf("again: %v", err)
	}
	for _, scope := range []string{"pool/paid", "tenant/acme"} {
		if _, ok := woken.Load(scope); !ok {
			t.Errorf("OnRelease not called for %s", scope)
		}
		got, _ := st.ListSlots(ctx, scope)
		for _, sl := range got {
			if sl.Holder != "" {
				t.Fatalf("still held: %+v", sl)
			}
		}
	}
}
