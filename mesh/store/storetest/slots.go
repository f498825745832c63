package storetest

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

const slotTTL = 10 * time.Second

// claimSlot claims a slot of scope for holder and fails the test on an error or a miss.
func (e *env) claimSlot(s store.Store, scope, holder string) store.Slot {
	e.t.Helper()
	sl, ok, err := s.ClaimSlot(e.ctx, scope, holder, slotTTL)
	if err != nil || !ok {
		e.t.Fatalf("claim %s for %s: ok=%v, %v", scope, holder, ok, err)
	}
	return sl
}

// noSlot checks that scope has no slot for holder now.
func (e *env) noSlot(scope, holder string) {
	e.t.Helper()
	if sl, ok, err := e.s.ClaimSlot(e.ctx, scope, holder, slotTTL); err != nil || ok {
		e.t.Fatalf("claim %s for %s: %+v ok=%v, %v; want no slot", scope, holder, sl, ok, err)
	}
}

func (e *env) sizeSlots(scope string, n int) {
	e.t.Helper()
	if err := e.s.SizeSlots(e.ctx, scope, n); err != nil {
		e.t.Fatalf("size %s %d: %v", scope, n, err)
	}
}

var slotTests = map[string]func(*env){
	"ClaimRelease": func(e *env) {
		e.noSlot("pool/paid", "a") // never sized: no slots
		e.sizeSlots("pool/paid", 2)
		e.sizeSlots("pool/paid", 2) // idempotent
		a := e.claimSlot(e.s, "pool/paid", "a")
		b := e.claimSlot(e.open(), "pool/paid", "b")
		if a.N != 0 || b.N != 1 || a.Epoch != 1 || b.Epoch != 1 || a.Holder != "a" || !a.Active ||
			!a.Expiry.Equal(e.clock.Now().Add(slotTTL)) {
			e.t.Fatalf("claims %+v %+v", a, b)
		}
		e.noSlot("pool/paid", "c")
		// Another scope is independent.
		e.sizeSlots("tenant/acme", 1)
		e.claimSlot(e.s, "tenant/acme", "c")
		if err := e.s.ReleaseSlot(e.ctx, a); err != nil {
			e.t.Fatalf("release: %v", err)
		}
		if err := e.s.ReleaseSlot(e.ctx, a); !errors.Is(err, store.ErrStaleEpoch) {
			e.t.Fatalf("second release: %v, want ErrStaleEpoch", err)
		}
		c := e.claimSlot(e.s, "pool/paid", "c")
		if c.N != 0 || c.Epoch != 2 {
			e.t.Fatalf("claim after release: %+v", c)
		}
		got, err := e.open().ListSlots(e.ctx, "pool/paid")
		if err != nil || len(got) != 2 || got[0].Holder != "c" || got[1].Holder != "b" || !got[0].Held(e.clock.Now()) {
			e.t.Fatalf("list: %+v, %v", got, err)
		}
	},
	"Invalid": func(e *env) {
		for _, n := range []int{-1, 1 << 30} {
			if err := e.s.SizeSlots(e.ctx, "pool/x", n); !errors.Is(err, store.ErrInvalidArgument) {
				e.t.Errorf("size %d: %v", n, err)
			}
		}
		if _, _, err := e.s.ClaimSlot(e.ctx, "pool/x", "", slotTTL); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Errorf("claim without holder: %v", err)
		}
		if _, err := e.s.RenewSlots(e.ctx, "", slotTTL); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Errorf("renew without holder: %v", err)
		}
		e.sizeSlots("pool/zero", 0)
		e.noSlot("pool/zero", "a")
	},
	// 64 claimers on 4 replicas against a scope of 2: never more than 2 held at once,
	// counted by what the claimers hold, and every claimer gets a slot in turn.
	"ConcurrentClaimsNeverExceed": func(e *env) {
		e.sizeSlots("pool/paid", 2)
		stores := []store.Store{e.s, e.open(), e.open(), e.open()}
		var (
			held, peak, claims atomic.Int64
			mu                 sync.Mutex
			errs               []error
		)
		fail := func(err error) {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		parallel(64, func(i int) {
			s := stores[i%len(stores)]
			holder := "h" + string(rune('a'+i%26)) + string(rune('a'+i/26))
			for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
				sl, ok, err := s.ClaimSlot(e.ctx, "pool/paid", holder, slotTTL)
				if err != nil {
					fail(err)
					return
				}
				if !ok {
					time.Sleep(time.Millisecond)
					continue
				}
				n := held.Add(1)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				claims.Add(1)
				time.Sleep(2 * time.Millisecond) // hold it, so that claimers overlap
				held.Add(-1)
				if err := s.ReleaseSlot(e.ctx, sl); err != nil {
					fail(err)
				}
				return
			}
		})
		if len(errs) > 0 {
			e.t.Fatalf("%d errors, first: %v", len(errs), errs[0])
		}
		if p := peak.Load(); p > 2 || p < 1 {
			e.t.Fatalf("peak held %d, want 1..2", p)
		}
		if c := claims.Load(); c != 64 {
			e.t.Fatalf("%d of 64 claimers got a slot within a minute", c)
		}
		got, _ := e.s.ListSlots(e.ctx, "pool/paid")
		for _, sl := range got {
			if sl.Holder != "" {
				e.t.Fatalf("slot left held: %+v", sl)
			}
		}
	},
	// An expired slot is claimed again with a higher epoch; its old holder can neither
	// release nor renew it.
	"ExpiredReclaimedFenced": func(e *env) {
		e.sizeSlots("pool/paid", 1)
		a := e.claimSlot(e.s, "pool/paid", "a")
		e.noSlot("pool/paid", "b")
		e.clock.Advance(slotTTL)
		b := e.claimSlot(e.open(), "pool/paid", "b")
		if b.N != a.N || b.Epoch <= a.Epoch || b.Holder != "b" {
			e.t.Fatalf("re-claim %+v after %+v", b, a)
		}
		if err := e.s.ReleaseSlot(e.ctx, a); !errors.Is(err, store.ErrStaleEpoch) {
			e.t.Fatalf("old holder's release: %v, want ErrStaleEpoch", err)
		}
		if got, err := e.s.RenewSlots(e.ctx, "a", slotTTL); err != nil || len(got) != 0 {
			e.t.Fatalf("old holder's renew: %+v, %v; want nothing", got, err)
		}
		got, _ := e.s.ListSlots(e.ctx, "pool/paid")
		if len(got) != 1 || got[0].Holder != "b" || got[0].Epoch != b.Epoch {
			e.t.Fatalf("list: %+v", got)
		}
	},
	// Renewing keeps a slot past its first TTL, in every scope the holder holds.
	"RenewKeeps": func(e *env) {
		e.sizeSlots("pool/paid", 1)
		e.sizeSlots("tenant/acme", 1)
		e.claimSlot(e.s, "pool/paid", "a")
		e.claimSlot(e.s, "tenant/acme", "a")
		e.clock.Advance(slotTTL * 6 / 10)
		got, err := e.open().RenewSlots(e.ctx, "a", slotTTL)
		if err != nil || len(got) != 2 || !got[0].Expiry.Equal(e.clock.Now().Add(slotTTL)) {
			e.t.Fatalf("renew: %+v, %v", got, err)
		}
		e.clock.Advance(slotTTL * 6 / 10) // past the first TTL
		e.noSlot("pool/paid", "b")
		e.noSlot("tenant/acme", "b")
		// A slot that expired but was not claimed is still the holder's.
		e.clock.Advance(slotTTL)
		if got, err := e.s.RenewSlots(e.ctx, "a", slotTTL); err != nil || len(got) != 2 {
			e.t.Fatalf("renew after expiry: %+v, %v", got, err)
		}
		e.noSlot("pool/paid", "b")
	},
	// A shrink cuts no holder off and admits nothing new until the held count is
	// under the new size; a grow brings the slots back with their epochs.
	"ShrinkGrow": func(e *env) {
		e.sizeSlots("pool/paid", 3)
		a := e.claimSlot(e.s, "pool/paid", "a")
		b := e.claimSlot(e.s, "pool/paid", "b")
		c := e.claimSlot(e.s, "pool/paid", "c")
		e.sizeSlots("pool/paid", 1)
		got, _ := e.s.ListSlots(e.ctx, "pool/paid")
		if len(got) != 3 || !got[0].Active || got[1].Active || got[2].Active {
			e.t.Fatalf("after the shrink: %+v", got)
		}
		if r, err := e.s.RenewSlots(e.ctx, "c", slotTTL); err != nil || len(r) != 1 || r[0].Active {
			e.t.Fatalf("renew of a slot above the size: %+v, %v", r, err)
		}
		for _, sl := range []store.Slot{a, b} {
			if err := e.s.ReleaseSlot(e.ctx, sl); err != nil {
				e.t.Fatal(err)
			}
			e.noSlot("pool/paid", "d") // c still runs above the new size
		}
		if err := e.s.ReleaseSlot(e.ctx, c); err != nil {
			e.t.Fatal(err)
		}
		d := e.claimSlot(e.s, "pool/paid", "d")
		e.noSlot("pool/paid", "e")
		got, _ = e.s.ListSlots(e.ctx, "pool/paid")
		if len(got) != 1 || got[0].N != 0 || d.N != 0 || d.Epoch != 2 {
			e.t.Fatalf("after the drain: %+v, claim %+v", got, d)
		}
		// An expired holder above the size no longer blocks.
		e.sizeSlots("pool/paid", 2)
		x := e.claimSlot(e.s, "pool/paid", "x")
		e.sizeSlots("pool/paid", 1)
		if err := e.s.ReleaseSlot(e.ctx, d); err != nil {
			e.t.Fatal(err)
		}
		e.noSlot("pool/paid", "e")
		e.clock.Advance(slotTTL)
		if y := e.claimSlot(e.s, "pool/paid", "y"); y.N != 0 {
			e.t.Fatalf("claim %+v", y)
		}
		// Grow: the slots come back, their epochs kept.
		e.sizeSlots("pool/paid", 3)
		z1 := e.claimSlot(e.s, "pool/paid", "z")
		z2 := e.claimSlot(e.s, "pool/paid", "z")
		if z1.N != 1 || z1.Epoch != x.Epoch+1 || z2.N != 2 || z2.Epoch != c.Epoch+1 {
			e.t.Fatalf("after the grow: %+v %+v (x %+v, c %+v)", z1, z2, x, c)
		}
		e.noSlot("pool/paid", "e")
	},
	// A run's pool and tenant slots in one statement each way, all or none.
	"ClaimSlotsAllOrNone": func(e *env) {
		e.sizeSlots("pool/paid", 1)
		e.sizeSlots("tenant/acme", 2)
		scopes := []string{"tenant/acme", "pool/paid"}
		a, ok, err := e.s.ClaimSlots(e.ctx, scopes, "a", slotTTL)
		if err != nil || !ok || len(a) != 2 || a[0].Scope != "tenant/acme" || a[1].Scope != "pool/paid" ||
			a[0].Holder != "a" || a[0].Epoch != 1 || !a[1].Active {
			e.t.Fatalf("claim both: %+v %v %v", a, ok, err)
		}
		if got, ok, err := e.open().ClaimSlots(e.ctx, scopes, "b", slotTTL); err != nil || ok || got != nil {
			e.t.Fatalf("claim with the pool full: %+v %v %v", got, ok, err)
		}
		// Nothing of the failed claim was kept: the tenant's second slot is free.
		if sl := e.claimSlot(e.s, "tenant/acme", "b"); sl.N != 1 {
			e.t.Fatalf("tenant slot %+v", sl)
		}
		if n, err := e.s.ReleaseSlots(e.ctx, a); err != nil || n != 2 {
			e.t.Fatalf("release both: %d, %v", n, err)
		}
		if n, err := e.s.ReleaseSlots(e.ctx, a); err != nil || n != 0 {
			e.t.Fatalf("release again: %d, %v", n, err)
		}
		if _, _, err := e.s.ClaimSlots(e.ctx, []string{"pool/paid", "pool/paid"}, "a", slotTTL); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("repeated scope: %v", err)
		}
		// Expired slots are claimed as in ClaimSlot, with a higher epoch.
		if _, ok, err := e.s.ClaimSlots(e.ctx, []string{"pool/paid"}, "c", slotTTL); !ok || err != nil {
			e.t.Fatalf("claim the pool: %v %v", ok, err)
		}
		e.clock.Advance(slotTTL)
		d, ok, err := e.s.ClaimSlots(e.ctx, scopes, "d", slotTTL)
		if err != nil || !ok || d[1].Epoch != 3 {
			e.t.Fatalf("claim after expiry: %+v %v %v", d, ok, err)
		}
	},
	// Concurrent multi-scope claims hold both caps: a tenant of 1 inside a pool of 2.
	"ConcurrentClaimSlotsNeverExceed": func(e *env) {
		e.sizeSlots("pool/paid", 2)
		e.sizeSlots("tenant/acme", 1)
		stores := []store.Store{e.s, e.open(), e.open(), e.open()}
		var held, peak, claims atomic.Int64
		var failures atomic.Int64
		parallel(32, func(i int) {
			s := stores[i%len(stores)]
			holder := "m" + string(rune('a'+i%26)) + string(rune('a'+i/26))
			for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
				got, ok, err := s.ClaimSlots(e.ctx, []string{"pool/paid", "tenant/acme"}, holder, slotTTL)
				if err != nil {
					failures.Add(1)
					return
				}
				if !ok {
					time.Sleep(time.Millisecond)
					continue
				}
				n := held.Add(1)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				claims.Add(1)
				time.Sleep(time.Millisecond)
				held.Add(-1)
				if n, err := s.ReleaseSlots(e.ctx, got); err != nil || n != 2 {
					failures.Add(1)
				}
				return
			}
		})
		if f := failures.Load(); f > 0 {
			e.t.Fatalf("%d claimers failed", f)
		}
		if p := peak.Load(); p != 1 {
			e.t.Fatalf("peak held %d, want 1 (the tenant's cap)", p)
		}
		if c := claims.Load(); c != 32 {
			e.t.Fatalf("%d of 32 claimers got their slots within a minute", c)
		}
	},
}
