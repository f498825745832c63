package storetest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

func (e *env) begin(s store.Store, tenant, key, owner string, ttl time.Duration) store.Begin {
	e.t.Helper()
	b, err := s.BeginTool(e.ctx, store.ToolBegin{Tenant: tenant, Key: key, Owner: owner, TTL: ttl, RunID: "run-1", Tool: "kv_put"})
	if err != nil {
		e.t.Fatalf("begin %s by %s: %v", key, owner, err)
	}
	return b
}

func wantOutcome(t tb, b store.Begin, want store.BeginOutcome, what string) {
	t.Helper()
	if b.Outcome != want {
		t.Fatalf("%s: outcome %v (record %+v), want %v", what, b.Outcome, b.Record, want)
	}
}

var toolTests = map[string]func(*env){
	"BeginInProgressDone": func(e *env) {
		a := e.begin(e.s, tenantA, "k1", "tr-a", 10*time.Second)
		wantOutcome(e.t, a, store.BeginStarted, "first begin")
		if a.Claim.Epoch != 1 || a.Claim.Owner != "tr-a" || a.Record.Status != store.ToolInProgress ||
			!a.Record.LeaseExpires.Equal(e.clock.Now().Add(10*time.Second)) || a.Record.Tool != "kv_put" || a.Record.RunID != "run-1" {
			e.t.Fatalf("started record %+v claim %+v", a.Record, a.Claim)
		}
		b := e.begin(e.s, tenantA, "k1", "tr-b", 10*time.Second)
		wantOutcome(e.t, b, store.BeginInProgress, "begin while in progress")
		if b.Record.Owner != "tr-a" || !b.Record.LeaseExpires.Equal(a.Record.LeaseExpires) {
			e.t.Fatalf("in-progress record %+v: want owner tr-a and its lease expiry", b.Record)
		}
		if err := e.s.CompleteTool(e.ctx, a.Claim, []byte(`{"ok":true}`)); err != nil {
			e.t.Fatal(err)
		}
		d := e.begin(e.s, tenantA, "k1", "tr-b", 10*time.Second)
		wantOutcome(e.t, d, store.BeginDone, "begin after completion")
		if string(d.Record.Result) != `{"ok":true}` {
			e.t.Fatalf("stored result %q", d.Record.Result)
		}
		wantErr(e.t, e.s.CompleteTool(e.ctx, a.Claim, []byte("again")), store.ErrStaleEpoch, "complete twice")
		other := e.begin(e.s, tenantB, "k1", "tr-b", 10*time.Second)
		wantOutcome(e.t, other, store.BeginStarted, "same key, another tenant")
		_, err := e.s.GetTool(e.ctx, tenantA, "nope")
		wantErr(e.t, err, store.ErrNotFound, "unknown record")
		_, err = e.s.BeginTool(e.ctx, store.ToolBegin{Tenant: tenantA, Key: "k", Owner: "o"})
		wantErr(e.t, err, store.ErrInvalidArgument, "begin without TTL")
	},
	"Failed": func(e *env) {
		a := e.begin(e.s, tenantA, "k1", "tr-a", 10*time.Second)
		if err := e.s.FailTool(e.ctx, a.Claim, "InvalidArgument", "bad args"); err != nil {
			e.t.Fatal(err)
		}
		f := e.begin(e.s, tenantA, "k1", "tr-b", 10*time.Second)
		wantOutcome(e.t, f, store.BeginFailed, "begin after failure")
		if f.Record.ErrorType != "InvalidArgument" || f.Record.Error != "bad args" {
			e.t.Fatalf("failed record %+v", f.Record)
		}
	},
	"TakeoverAfterExpiryFencesOldOwner": func(e *env) {
		a := e.begin(e.s, tenantA, "k1", "tr-a", 5*time.Second)
		e.clock.Advance(5*time.Second - time.Millisecond)
		wantOutcome(e.t, e.begin(e.s, tenantA, "k1", "tr-b", 5*time.Second), store.BeginInProgress, "1 ms before expiry")
		e.clock.Advance(time.Millisecond)
		b := e.begin(e.s, tenantA, "k1", "tr-b", 5*time.Second)
		wantOutcome(e.t, b, store.BeginStarted, "begin after the lease expired")
		if b.Claim.Epoch != 2 || b.Record.Owner != "tr-b" {
			e.t.Fatalf("takeover claim %+v", b.Claim)
		}
		wantErr(e.t, e.s.HeartbeatTool(e.ctx, a.Claim, time.Second), store.ErrStaleEpoch, "old owner's heartbeat")
		wantErr(e.t, e.s.CompleteTool(e.ctx, a.Claim, nil, store.KVPut{Key: "x", Value: []byte("a")}), store.ErrStaleEpoch, "old owner's complete")
		wantErr(e.t, e.s.FailTool(e.ctx, a.Claim, "", "x"), store.ErrStaleEpoch, "old owner's fail")
		wantErr(e.t, e.s.ReleaseTool(e.ctx, a.Claim), store.ErrStaleEpoch, "old owner's release")
		if _, err := e.s.GetKV(e.ctx, tenantA, "x"); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("the fenced-off completion's effect is visible: %v", err)
		}
		if err := e.s.CompleteTool(e.ctx, b.Claim, []byte("b")); err != nil {
			e.t.Fatal(err)
		}
	},
	"HeartbeatKeepsLease": func(e *env) {
		a := e.begin(e.s, tenantA, "k1", "tr-a", 5*time.Second)
		e.clock.Advance(4 * time.Second)
		if err := e.s.HeartbeatTool(e.ctx, a.Claim, 5*time.Second); err != nil {
			e.t.Fatal(err)
		}
		e.clock.Advance(4 * time.Second)
		wantOutcome(e.t, e.begin(e.s, tenantA, "k1", "tr-b", 5*time.Second), store.BeginInProgress, "after a heartbeat")
	},
	"ReleaseLetsNextBeginStart": func(e *env) {
		a := e.begin(e.s, tenantA, "k1", "tr-a", time.Hour)
		if err := e.s.ReleaseTool(e.ctx, a.Claim); err != nil {
			e.t.Fatal(err)
		}
		b := e.begin(e.s, tenantA, "k1", "tr-b", time.Hour)
		wantOutcome(e.t, b, store.BeginStarted, "begin after release")
		if b.Claim.Epoch != 2 {
			e.t.Fatalf("epoch after release %d", b.Claim.Epoch)
		}
	},
	"ConcurrentBeginOneStarts": func(e *env) {
		stores := []store.Store{e.s, e.open()}
		var (
			mu       sync.Mutex
			outcomes = map[store.BeginOutcome]int{}
			errs     []error
		)
		parallel(10, func(i int) {
			b, err := stores[i%2].BeginTool(e.ctx, store.ToolBegin{Tenant: tenantA, Key: "k1", Owner: fmt.Sprintf("tr-%d", i), TTL: time.Minute})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			outcomes[b.Outcome]++
		})
		if len(errs) > 0 || outcomes[store.BeginStarted] != 1 || outcomes[store.BeginInProgress] != 9 {
			e.t.Fatalf("10 concurrent begins: %v, errors %v; want 1 started, 9 in progress", outcomes, errs)
		}
	},
	"EffectsCommitWithRecord": func(e *env) {
		a := e.begin(e.s, tenantA, "call-1", "tr-a", time.Minute)
		err := e.s.CompleteTool(e.ctx, a.Claim, []byte("ok"),
			store.KVPut{Key: "color", Value: []byte("blue")},
			store.Notify{Channel: "ops", Payload: []byte("hello")},
			store.Notify{Channel: "ops", Payload: []byte("again")})
		if err != nil {
			e.t.Fatal(err)
		}
		kv, err := e.s.GetKV(e.ctx, tenantA, "color")
		if err != nil || string(kv.Value) != "blue" || kv.Version != 1 || kv.IdempotencyKey != "call-1" {
			e.t.Fatalf("kv %+v %v", kv, err)
		}
		out, err := e.s.ListOutbox(e.ctx, tenantA, 0, 0)
		if err != nil || len(out) != 2 || out[0].Channel != "ops" || string(out[0].Payload) != "hello" ||
			out[0].IdempotencyKey != "call-1" || out[0].Seq != 0 || out[1].Seq != 1 || out[1].ID <= out[0].ID {
			e.t.Fatalf("outbox %+v %v", out, err)
		}
		if more, _ := e.s.ListOutbox(e.ctx, tenantA, out[0].ID, 0); len(more) != 1 {
			e.t.Fatalf("outbox after %d: %d entries", out[0].ID, len(more))
		}
		b := e.begin(e.s, tenantA, "call-2", "tr-a", time.Minute)
		if err := e.s.CompleteTool(e.ctx, b.Claim, nil, store.KVPut{Key: "color", Value: []byte("red")}); err != nil {
			e.t.Fatal(err)
		}
		kv, _ = e.s.GetKV(e.ctx, tenantA, "color")
		if string(kv.Value) != "red" || kv.Version != 2 || kv.IdempotencyKey != "call-2" {
			e.t.Fatalf("kv after a second call %+v", kv)
		}
		if _, err := e.s.GetKV(e.ctx, tenantB, "color"); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("another tenant's kv: %v", err)
		}
		if out, _ := e.s.ListOutbox(e.ctx, tenantB, 0, 0); len(out) != 0 {
			e.t.Fatalf("another tenant's outbox: %d entries", len(out))
		}
	},
	"EffectFailureRollsBackRecord": func(e *env) {
		a := e.begin(e.s, tenantA, "call-1", "tr-a", time.Minute)
		// The first effect is applied, then the second is invalid: nothing may remain.
		err := e.s.CompleteTool(e.ctx, a.Claim, []byte("ok"),
			store.KVPut{Key: "color", Value: []byte("blue")},
			store.Notify{Channel: "ops", Payload: []byte("hello")},
			store.KVPut{Key: ""})
		wantErr(e.t, err, store.ErrInvalidArgument, "complete with an invalid effect")
		rec, err := e.s.GetTool(e.ctx, tenantA, "call-1")
		if err != nil || rec.Status != store.ToolInProgress {
			e.t.Fatalf("record after a failed completion: %+v %v", rec, err)
		}
		if _, err := e.s.GetKV(e.ctx, tenantA, "color"); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("kv effect survived the rollback: %v", err)
		}
		if out, _ := e.s.ListOutbox(e.ctx, tenantA, 0, 0); len(out) != 0 {
			e.t.Fatalf("outbox effect survived the rollback: %d entries", len(out))
		}
		if err := e.s.CompleteTool(e.ctx, a.Claim, []byte("ok"), store.KVPut{Key: "color", Value: []byte("blue")}); err != nil {
			e.t.Fatalf("complete after the failed attempt: %v", err)
		}
	},
	"ExactlyOnceUnderCrowdAndTakeover": func(e *env) {
		// 12 workers on two replicas run the same two tool calls; the first owner of
		// call-0 "crashes" (never completes) and its lease expires. Each call's
		// effects must happen once.
		stores := []store.Store{e.s, e.open()}
		crashed := e.begin(e.s, tenantA, "call-0", "tr-crashed", 10*time.Second)
		wantOutcome(e.t, crashed, store.BeginStarted, "crashed owner's begin")
		e.clock.Advance(10 * time.Second)
		ctx, cancel := context.WithTimeout(e.ctx, 30*time.Second)
		defer cancel()
		var (
			mu   sync.Mutex
			errs []error
			runs = map[string]int{}
		)
		parallel(12, func(i int) {
			s := stores[i%2]
			key := fmt.Sprintf("call-%d", i%2)
			owner := fmt.Sprintf("tr-%d", i)
			for {
				b, err := s.BeginTool(ctx, store.ToolBegin{Tenant: tenantA, Key: key, Owner: owner, TTL: time.Minute})
				if err == nil && b.Outcome == store.BeginStarted {
					mu.Lock()
					runs[key]++
					mu.Unlock()
					err = s.CompleteTool(ctx, b.Claim, []byte(owner),
						store.KVPut{Key: "k-" + key, Value: []byte(owner)}, store.Notify{Channel: "c", Payload: []byte(key)})
				}
				if err == nil && b.Outcome == store.BeginInProgress {
					_, err = store.WaitTool(ctx, s, tenantA, key, 20*time.Millisecond, e.clock.Now)
					if err == nil {
						continue
					}
				}
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
				return
			}
		})
		if len(errs) > 0 {
			e.t.Fatalf("errors: %v", errs)
		}
		if runs["call-0"] != 1 || runs["call-1"] != 1 {
			e.t.Fatalf("executions per key %v, want 1 each", runs)
		}
		for _, key := range []string{"call-0", "call-1"} {
			kv, err := e.s.GetKV(e.ctx, tenantA, "k-"+key)
			if err != nil || kv.Version != 1 {
				e.t.Fatalf("kv of %s: %+v %v, want written once", key, kv, err)
			}
			rec, _ := e.s.GetTool(e.ctx, tenantA, key)
			if rec.Status != store.ToolDone || string(rec.Result) != string(kv.Value) {
				e.t.Fatalf("record %s: %+v, kv value %q", key, rec, kv.Value)
			}
		}
		out, _ := e.s.ListOutbox(e.ctx, tenantA, 0, 0)
		if len(out) != 2 {
			e.t.Fatalf("outbox has %d entries, want 2 (one notify per call)", len(out))
		}
		wantErr(e.t, e.s.CompleteTool(e.ctx, crashed.Claim, nil, store.KVPut{Key: "k-call-0"}), store.ErrStaleEpoch, "the crashed owner comes back")
	},
	"WaitTool": func(e *env) {
		a := e.begin(e.s, tenantA, "k1", "tr-a", 10*time.Second)
		done := make(chan store.ToolRecord, 1)
		errc := make(chan error, 1)
		go func() {
			rec, err := store.WaitTool(e.ctx, e.s, tenantA, "k1", 10*time.Millisecond, e.clock.Now)
			errc <- err
			done <- rec
		}()
		if err := e.s.CompleteTool(e.ctx, a.Claim, []byte("r")); err != nil {
			e.t.Fatal(err)
		}
		if err := <-errc; err != nil {
			e.t.Fatal(err)
		}
		if rec := <-done; rec.Status != store.ToolDone || string(rec.Result) != "r" {
			e.t.Fatalf("wait returned %+v", rec)
		}
		// An expired in-progress record returns at once, for the caller to take over.
		e.begin(e.s, tenantA, "k2", "tr-a", 10*time.Second)
		e.clock.Advance(10 * time.Second)
		rec, err := store.WaitTool(e.ctx, e.s, tenantA, "k2", 0, e.clock.Now)
		if err != nil || rec.Status != store.ToolInProgress {
			e.t.Fatalf("wait on an expired lease: %+v %v", rec, err)
		}
		// A live one waits until the context ends.
		e.begin(e.s, tenantA, "k3", "tr-a", 10*time.Second)
		ctx, cancel := context.WithTimeout(e.ctx, 30*time.Millisecond)
		defer cancel()
		_, err = store.WaitTool(ctx, e.s, tenantA, "k3", 0, e.clock.Now)
		wantErr(e.t, err, context.DeadlineExceeded, "wait on a live lease")
		_, err = store.WaitTool(e.ctx, e.s, tenantA, "nope", 0, e.clock.Now)
		wantErr(e.t, err, store.ErrNotFound, "wait on an unknown key")
	},
}
