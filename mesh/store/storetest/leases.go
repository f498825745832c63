package storetest

import (
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

var leaseTests = map[string]func(*env){
	"RunOwnersAreTheLiveLeases": func(e *env) {
		if got, err := e.s.RunOwners(e.ctx); err != nil || len(got) != 0 {
			e.t.Fatalf("owners of an empty store: %v, %v", got, err)
		}
		e.create(tenantA, "", "orch-b")
		e.create(tenantB, "", "orch-a")
		e.create(tenantA, "", "orch-a")
		e.create(tenantA, "", "") // not claimed: no owner
		done := e.create(tenantA, "", "orch-c")
		if _, err := e.s.FinishRun(e.ctx, done.Lease(), store.RunResult{Status: store.StatusSucceeded}); err != nil {
			e.t.Fatal(err)
		}
		got, err := e.s.RunOwners(e.ctx)
		if err != nil || fmt.Sprint(got) != "[orch-a orch-b]" {
			e.t.Fatalf("owners: %v, %v; want [orch-a orch-b] (orch-c's run ended)", got, err)
		}
		e.clock.Advance(5 * time.Second)
		e.create(tenantA, "", "orch-d")
		e.clock.Advance(6 * time.Second) // the first leases (10 s) expired, orch-d's not
		got, err = e.s.RunOwners(e.ctx)
		if err != nil || fmt.Sprint(got) != "[orch-d]" {
			e.t.Fatalf("owners after the first leases expired: %v, %v; want [orch-d]", got, err)
		}
	},
	"ClaimHeldExpiredTakeover": func(e *env) {
		r := e.create(tenantA, "", "")
		a := e.claim(tenantA, r.RunID, "orch-a", 10*time.Second)
		if a.Epoch != 1 || a.Owner != "orch-a" || a.Status != store.StatusRunning ||
			!a.LeaseExpires.Equal(e.clock.Now().Add(10*time.Second)) {
			e.t.Fatalf("first claim: %+v", a)
		}
		_, err := e.s.ClaimRun(e.ctx, tenantA, r.RunID, "orch-b", 10*time.Second)
		wantErr(e.t, err, store.ErrLeaseHeld, "claim of a live lease")
		var held *store.LeaseHeldError
		if !errors.As(err, &held) || held.Owner != "orch-a" || held.Epoch != 1 || !held.Expires.Equal(a.LeaseExpires) {
			e.t.Fatalf("lease-held error %#v, want owner orch-a epoch 1 until %v", err, a.LeaseExpires)
		}
		e.clock.Advance(9 * time.Second)
		_, err = e.s.ClaimRun(e.ctx, tenantA, r.RunID, "orch-b", 10*time.Second)
		wantErr(e.t, err, store.ErrLeaseHeld, "claim 1 s before expiry")
		e.clock.Advance(time.Second)
		b := e.claim(tenantA, r.RunID, "orch-b", 10*time.Second)
		if b.Epoch != 2 || b.Owner != "orch-b" {
			e.t.Fatalf("takeover at expiry: %+v, want epoch 2 by orch-b", b)
		}
		_, err = e.s.HeartbeatRun(e.ctx, a.Lease(), 10*time.Second)
		wantErr(e.t, err, store.ErrStaleEpoch, "heartbeat by the old owner")
		wantErr(e.t, e.s.ReleaseRun(e.ctx, a.Lease()), store.ErrStaleEpoch, "release by the old owner")
		_, err = e.s.ClaimRun(e.ctx, tenantB, r.RunID, "orch-c", time.Second)
		wantErr(e.t, err, store.ErrNotFound, "claim through another tenant")
		_, err = e.s.ClaimRun(e.ctx, tenantA, "nope", "orch-c", time.Second)
		wantErr(e.t, err, store.ErrNotFound, "claim of an unknown run")
		_, err = e.s.ClaimRun(e.ctx, tenantA, r.RunID, "", time.Second)
		wantErr(e.t, err, store.ErrInvalidArgument, "claim without owner")
	},
	"ReclaimBySameOwnerBumpsEpoch": func(e *env) {
		r := e.create(tenantA, "", "orch-a")
		again := e.claim(tenantA, r.RunID, "orch-a", 10*time.Second)
		if again.Epoch != 2 {
			e.t.Fatalf("re-claim by the same owner: epoch %d, want 2", again.Epoch)
		}
		_, err := e.s.HeartbeatRun(e.ctx, r.Lease(), time.Second)
		wantErr(e.t, err, store.ErrStaleEpoch, "heartbeat of the earlier incarnation")
	},
	"HeartbeatExtends": func(e *env) {
		r := e.create(tenantA, "", "orch-a")
		e.clock.Advance(8 * time.Second)
		l, err := e.s.HeartbeatRun(e.ctx, r.Lease(), 10*time.Second)
		if err != nil || !l.Expires.Equal(e.clock.Now().Add(10*time.Second)) || l.Epoch != 1 {
			e.t.Fatalf("heartbeat: %+v %v", l, err)
		}
		e.clock.Advance(8 * time.Second) // past the first expiry, before the new one
		_, err = e.s.ClaimRun(e.ctx, tenantA, r.RunID, "orch-b", time.Second)
		wantErr(e.t, err, store.ErrLeaseHeld, "claim after a heartbeat")
		// Expired but not taken over: the epoch is still current, so the lease extends.
		e.clock.Advance(5 * time.Second)
		if _, err := e.s.HeartbeatRun(e.ctx, l, 10*time.Second); err != nil {
			e.t.Fatalf("heartbeat of an expired lease nobody took: %v", err)
		}
		got, _ := e.s.GetRun(e.ctx, tenantA, r.RunID)
		if !got.LeaseExpires.Equal(e.clock.Now().Add(10 * time.Second)) {
			e.t.Fatalf("stored expiry %v", got.LeaseExpires)
		}
	},
	"Release": func(e *env) {
		r := e.create(tenantA, "", "orch-a")
		if err := e.s.ReleaseRun(e.ctx, r.Lease()); err != nil {
			e.t.Fatal(err)
		}
		got, _ := e.s.GetRun(e.ctx, tenantA, r.RunID)
		if got.Owner != "" || !got.LeaseExpires.IsZero() || got.Epoch != 1 || got.Status != store.StatusRunning {
			e.t.Fatalf("released run %+v", got)
		}
		b := e.claim(tenantA, r.RunID, "orch-b", time.Second) // at once, no expiry wait
		if b.Epoch != 2 {
			e.t.Fatalf("claim after release: epoch %d", b.Epoch)
		}
		_, err := e.s.HeartbeatRun(e.ctx, r.Lease(), time.Second)
		wantErr(e.t, err, store.ErrStaleEpoch, "heartbeat after release")
	},
	"ClaimConcurrentOneWins": func(e *env) {
		r := e.create(tenantA, "", "")
		stores := []store.Store{e.s, e.open()}
		var (
			mu      sync.Mutex
			winners []string
			other   []error
		)
		parallel(8, func(i int) {
			owner := fmt.Sprintf("orch-%d", i)
			_, err := stores[i%2].ClaimRun(e.ctx, tenantA, r.RunID, owner, 10*time.Second)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				winners = append(winners, owner)
			case !errors.Is(err, store.ErrLeaseHeld):
				other = append(other, err)
			}
		})
		if len(winners) != 1 || len(other) > 0 {
			e.t.Fatalf("8 concurrent claims: winners %v, unexpected errors %v; want exactly one winner", winners, other)
		}
		got, _ := e.s.GetRun(e.ctx, tenantA, r.RunID)
		if got.Owner != winners[0] || got.Epoch != 1 {
			e.t.Fatalf("stored lease %s epoch %d, want %s epoch 1", got.Owner, got.Epoch, winners[0])
		}
	},
	"ClaimExpiredRuns": func(e *env) {
		live := e.create(tenantA, "", "orch-a")
		e.clock.Advance(time.Second)
		old1 := e.create(tenantA, "", "orch-a")
		old2 := e.create(tenantB, "", "orch-a")
		done := e.create(tenantA, "", "orch-a")
		if _, err := e.s.FinishRun(e.ctx, done.Lease(), store.RunResult{Status: store.StatusCancelled}); err != nil {
			e.t.Fatal(err)
		}
		pending := e.create(tenantA, "", "")
		if _, err := e.s.HeartbeatRun(e.ctx, live.Lease(), time.Minute); err != nil {
			e.t.Fatal(err)
		}
		e.clock.Advance(10 * time.Second) // old1, old2 expire; live does not
		got, err := e.s.ClaimExpiredRuns(e.ctx, "orch-b", 10*time.Second, 10)
		if err != nil {
			e.t.Fatal(err)
		}
		want := map[string]int64{old1.RunID: 2, old2.RunID: 2, pending.RunID: 1}
		if len(got) != len(want) {
			e.t.Fatalf("claimed %d runs, want %d (two expired, one unowned)", len(got), len(want))
		}
		for _, r := range got {
			if ep, ok := want[r.RunID]; !ok || r.Epoch != ep || r.Owner != "orch-b" {
				e.t.Fatalf("claimed %s epoch %d owner %s; want %v", r.RunID, r.Epoch, r.Owner, want)
			}
		}
		again, err := e.s.ClaimExpiredRuns(e.ctx, "orch-c", 10*time.Second, 10)
		if err != nil || len(again) != 0 {
			e.t.Fatalf("second sweep claimed %d runs (%v), want 0", len(again), err)
		}
	},
	"ClaimExpiredConcurrentSweepsDisjoint": func(e *env) {
		const n = 12
		for range n {
			e.create(tenantA, "", "dead")
		}
		e.clock.Advance(time.Minute)
		stores := []store.Store{e.s, e.open(), e.open()}
		var (
			mu   sync.Mutex
			seen = map[string]string{}
			errs []error
		)
		parallel(len(stores), func(i int) {
			owner := fmt.Sprintf("sweeper-%d", i)
			runs, err := stores[i].ClaimExpiredRuns(e.ctx, owner, time.Minute, 100)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			}
			for _, r := range runs {
				if prev, dup := seen[r.RunID]; dup {
					errs = append(errs, fmt.Errorf("run %s claimed by %s and %s", r.RunID, prev, owner))
				}
				seen[r.RunID] = owner
			}
		})
		if len(errs) > 0 || len(seen) != n {
			e.t.Fatalf("concurrent sweeps: %d of %d runs claimed, errors %v", len(seen), n, errs)
		}
	},
}

var checkpointTests = map[string]func(*env){
	"PutAndListInOrder": func(e *env) {
		r := e.create(tenantA, "", "orch-a")
		var want []store.Checkpoint
		for _, step := range []int{2, 0, 1} {
			m, tl := checkpointBytes(step)
			c := store.Checkpoint{Step: step, ModelOutput: m, ToolResults: tl, Tokens: int64(100 + step)}
			if err := e.s.PutCheckpoint(e.ctx, r.Lease(), c); err != nil {
				e.t.Fatal(err)
			}
			want = append(want, c)
		}
		sort.Slice(want, func(i, j int) bool { return want[i].Step < want[j].Step })
		got, err := e.s.ListCheckpoints(e.ctx, tenantA, r.RunID)
		if err != nil || len(got) != 3 {
			e.t.Fatalf("list: %d checkpoints, %v", len(got), err)
		}
		for i := range got {
			if !sameCheckpoint(got[i], want[i]) || got[i].Epoch != 1 || !got[i].CreatedAt.Equal(e.clock.Now()) {
				e.t.Fatalf("checkpoint %d: %+v, want %+v at epoch 1", i, got[i], want[i])
			}
		}
		other, err := e.s.ListCheckpoints(e.ctx, tenantB, r.RunID)
		if err != nil || len(other) != 0 {
			e.t.Fatalf("another tenant read %d checkpoints (%v)", len(other), err)
		}
		wantErr(e.t, e.s.PutCheckpoint(e.ctx, r.Lease(), store.Checkpoint{Step: -1}), store.ErrInvalidArgument, "negative step")
	},
	"RewriteSameIsNoopDifferentConflicts": func(e *env) {
		r := e.create(tenantA, "", "orch-a")
		c := store.Checkpoint{Step: 0, ModelOutput: []byte("m"), ToolResults: []byte("t"), Tokens: 3}
		if err := e.s.PutCheckpoint(e.ctx, r.Lease(), c); err != nil {
			e.t.Fatal(err)
		}
		if err := e.s.PutCheckpoint(e.ctx, r.Lease(), c); err != nil {
			e.t.Fatalf("same checkpoint again: %v", err)
		}
		c.ModelOutput = []byte("other")
		wantErr(e.t, e.s.PutCheckpoint(e.ctx, r.Lease(), c), store.ErrConflict, "a different step 0")
	},
	"StaleEpochRejected": func(e *env) {
		r := e.create(tenantA, "", "orch-a")
		m, tl := checkpointBytes(0)
		if err := e.s.PutCheckpoint(e.ctx, r.Lease(), store.Checkpoint{Step: 0, ModelOutput: m, ToolResults: tl}); err != nil {
			e.t.Fatal(err)
		}
		e.clock.Advance(10 * time.Second)
		b := e.claim(tenantA, r.RunID, "orch-b", 10*time.Second)
		m1, tl1 := checkpointBytes(1)
		err := e.s.PutCheckpoint(e.ctx, r.Lease(), store.Checkpoint{Step: 1, ModelOutput: m1, ToolResults: tl1})
		wantErr(e.t, err, store.ErrStaleEpoch, "checkpoint by the old owner")
		if err := e.s.PutCheckpoint(e.ctx, b.Lease(), store.Checkpoint{Step: 1, ModelOutput: m1, ToolResults: tl1}); err != nil {
			e.t.Fatal(err)
		}
		got, _ := e.s.ListCheckpoints(e.ctx, tenantA, r.RunID)
		if len(got) != 2 || got[0].Epoch != 1 || got[1].Epoch != 2 {
			e.t.Fatalf("checkpoints %+v: want step 0 at epoch 1, step 1 at epoch 2", got)
		}
		if _, err := e.s.FinishRun(e.ctx, b.Lease(), store.RunResult{Status: store.StatusSucceeded}); err != nil {
			e.t.Fatal(err)
		}
		err = e.s.PutCheckpoint(e.ctx, b.Lease(), store.Checkpoint{Step: 2})
		wantErr(e.t, err, store.ErrRunFinished, "checkpoint after finish")
		err = e.s.PutCheckpoint(e.ctx, store.Lease{Tenant: tenantA, RunID: "nope", Owner: "x", Epoch: 1}, store.Checkpoint{})
		wantErr(e.t, err, store.ErrNotFound, "checkpoint of an unknown run")
	},
	"TakeoverRaceSingleEpochPerStep": func(e *env) {
		// Owner A writes steps as fast as it can while B takes the run over: every
		// step is written exactly once, under one epoch, A's before B's.
		r := e.create(tenantA, "", "orch-a")
		other := e.open()
		var (
			aSteps int
			aErr   error
			wg     sync.WaitGroup
		)
		claimed := make(chan store.Run, 1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for step := 0; step < 10000; step++ {
				m, tl := checkpointBytes(step)
				if err := e.s.PutCheckpoint(e.ctx, r.Lease(), store.Checkpoint{Step: step, ModelOutput: m, ToolResults: tl}); err != nil {
					aErr = err
					return
				}
				aSteps = step + 1
				if step == 20 {
					e.clock.Advance(11 * time.Second) // A's lease expires; it has not noticed
					go func() {
						b, err := other.ClaimRun(e.ctx, tenantA, r.RunID, "orch-b", time.Minute)
						if err != nil {
							b.Owner = "error: " + err.Error()
						}
						claimed <- b
					}()
				}
			}
		}()
		wg.Wait()
		b := <-claimed
		if b.Epoch != 2 {
			e.t.Fatalf("takeover claim: %+v", b)
		}
		if !errors.Is(aErr, store.ErrStaleEpoch) {
			e.t.Fatalf("owner A stopped with %v after %d steps, want ErrStaleEpoch", aErr, aSteps)
		}
		cps, err := other.ListCheckpoints(e.ctx, tenantA, r.RunID)
		if err != nil {
			e.t.Fatal(err)
		}
		if len(cps) != aSteps {
			e.t.Fatalf("%d checkpoints stored, A wrote %d successfully", len(cps), aSteps)
		}
		m, tl := checkpointBytes(aSteps)
		if err := other.PutCheckpoint(e.ctx, b.Lease(), store.Checkpoint{Step: aSteps, ModelOutput: m, ToolResults: tl}); err != nil {
			e.t.Fatalf("B resumes at step %d: %v", aSteps, err)
		}
		cps, _ = other.ListCheckpoints(e.ctx, tenantA, r.RunID)
		for i, c := range cps {
			wantEpoch := int64(1)
			if i == aSteps {
				wantEpoch = 2
			}
			if c.Step != i || c.Epoch != wantEpoch {
				e.t.Fatalf("checkpoint %d: step %d epoch %d, want step %d epoch %d", i, c.Step, c.Epoch, i, wantEpoch)
			}
		}
	},
}
