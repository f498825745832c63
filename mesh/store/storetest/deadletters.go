package storetest

import (
	"errors"
	"sync"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

func (e *env) addDL(tenant, runID, step string) store.DeadLetter {
	e.t.Helper()
	d, _, err := e.s.AddDeadLetter(e.ctx, store.DeadLetter{
		Tenant: tenant, RunID: runID, Step: step, ErrorType: "tool_error", Attempts: 3,
		LastError: "boom", Payload: []byte(`{"args":1}`), IdempotencyKey: "idem-" + step,
	})
	if err != nil {
		e.t.Fatal(err)
	}
	return d
}

var deadLetterTests = map[string]func(*env){
	"AddIdempotentGet": func(e *env) {
		d, added, err := e.s.AddDeadLetter(e.ctx, store.DeadLetter{
			Tenant: tenantA, RunID: "run-1", Step: "2", ErrorType: "tool_error", Attempts: 3,
			LastError: "boom", Payload: []byte(`{"vendor":"acme"}`), IdempotencyKey: "k",
		})
		if err != nil || !added || d.ID == "" || !d.CreatedAt.Equal(e.clock.Now()) || d.Attempts != 3 ||
			string(d.Payload) != `{"vendor":"acme"}` || d.IdempotencyKey != "k" || !d.ReplayedAt.IsZero() {
			e.t.Fatalf("add: %+v added=%v %v", d, added, err)
		}
		again, added, err := e.s.AddDeadLetter(e.ctx, store.DeadLetter{Tenant: tenantA, RunID: "run-1", Step: "2", LastError: "other"})
		if err != nil || added || again.ID != d.ID || again.LastError != "boom" {
			e.t.Fatalf("second add for the same run and step: %+v added=%v %v", again, added, err)
		}
		got, err := e.s.GetDeadLetter(e.ctx, tenantA, d.ID)
		if err != nil || got.ID != d.ID || got.Step != "2" {
			e.t.Fatalf("get %+v %v", got, err)
		}
		if _, err := e.s.GetDeadLetter(e.ctx, "", d.ID); err != nil {
			e.t.Fatalf("operator get across tenants: %v", err)
		}
		_, err = e.s.GetDeadLetter(e.ctx, tenantB, d.ID)
		wantErr(e.t, err, store.ErrNotFound, "another tenant's dead letter")
		_, _, err = e.s.AddDeadLetter(e.ctx, store.DeadLetter{Tenant: tenantA, RunID: "run-1"})
		wantErr(e.t, err, store.ErrInvalidArgument, "dead letter without step")
	},
	"AddConcurrentOnce": func(e *env) {
		stores := []store.Store{e.s, e.open()}
		var (
			mu    sync.Mutex
			added int
			ids   = map[string]bool{}
			errs  []error
		)
		parallel(8, func(i int) {
			d, a, err := stores[i%2].AddDeadLetter(e.ctx, store.DeadLetter{Tenant: tenantA, RunID: "run-1", Step: "0"})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			ids[d.ID] = true
			if a {
				added++
			}
		})
		if len(errs) > 0 || added != 1 || len(ids) != 1 {
			e.t.Fatalf("8 concurrent adds: added %d, ids %v, errors %v", added, ids, errs)
		}
	},
	"ReplayOnceDepthReopen": func(e *env) {
		d := e.addDL(tenantA, "run-1", "3")
		e.addDL(tenantA, "run-2", "0")
		e.addDL(tenantB, "run-3", "1")
		depth := func(tenant string) int64 {
			n, err := e.s.DeadLetterDepth(e.ctx, tenant)
			if err != nil {
				e.t.Fatal(err)
			}
			return n
		}
		if depth("") != 3 || depth(tenantA) != 2 || depth(tenantB) != 1 {
			e.t.Fatalf("depth all=%d a=%d b=%d", depth(""), depth(tenantA), depth(tenantB))
		}
		_, err := e.s.MarkReplayed(e.ctx, tenantB, d.ID)
		wantErr(e.t, err, store.ErrNotFound, "replay through another tenant")
		e.clock.Advance(time.Second)
		r, err := e.s.MarkReplayed(e.ctx, tenantA, d.ID)
		if err != nil || r.ReplayCount != 1 || !r.ReplayedAt.Equal(e.clock.Now()) {
			e.t.Fatalf("first replay %+v %v", r, err)
		}
		r2, err := e.s.MarkReplayed(e.ctx, tenantA, d.ID)
		wantErr(e.t, err, store.ErrAlreadyReplayed, "second replay")
		if r2.ID != d.ID || r2.ReplayCount != 1 {
			e.t.Fatalf("second replay returned %+v, want the record with one replay", r2)
		}
		if depth(tenantA) != 1 {
			e.t.Fatalf("depth after replay %d, want 1", depth(tenantA))
		}
		// The replayed step fails again: the same dead letter reopens.
		e.clock.Advance(time.Second)
		re, added, err := e.s.AddDeadLetter(e.ctx, store.DeadLetter{Tenant: tenantA, RunID: "run-1", Step: "3", LastError: "boom 2", Attempts: 1})
		if err != nil || !added || re.ID != d.ID || !re.ReplayedAt.IsZero() || re.ReplayCount != 1 || re.LastError != "boom 2" ||
			!re.CreatedAt.Equal(e.clock.Now()) {
			e.t.Fatalf("reopen: %+v added=%v %v", re, added, err)
		}
		if depth(tenantA) != 2 {
			e.t.Fatalf("depth after reopen %d", depth(tenantA))
		}
		_, err = e.s.MarkReplayed(e.ctx, "", "nope")
		wantErr(e.t, err, store.ErrNotFound, "replay of an unknown dead letter")
	},
	"ListPages": func(e *env) {
		var ids []string
		for _, step := range []string{"0", "1", "2", "3", "4"} {
			ids = append(ids, e.addDL(tenantA, "run-1", step).ID)
		}
		e.addDL(tenantA, "run-2", "0")
		e.addDL(tenantB, "run-3", "0")
		if _, err := e.s.MarkReplayed(e.ctx, tenantA, ids[0]); err != nil {
			e.t.Fatal(err)
		}
		var got []string
		after := ""
		for {
			page, next, err := e.s.ListDeadLetters(e.ctx, store.DeadLetterQuery{Tenant: tenantA, RunID: "run-1", After: after, Limit: 2})
			if err != nil || len(page) > 2 {
				e.t.Fatalf("page: %d, %v", len(page), err)
			}
			for _, d := range page {
				got = append(got, d.ID)
			}
			if next == "" {
				break
			}
			after = next
		}
		if len(got) != 4 || got[0] != ids[4] || got[3] != ids[1] {
			e.t.Fatalf("open dead letters of run-1 newest first: %v, want %v reversed without %s", got, ids, ids[0])
		}
		all, _, _ := e.s.ListDeadLetters(e.ctx, store.DeadLetterQuery{IncludeReplayed: true})
		if len(all) != 7 {
			e.t.Fatalf("operator list with replayed: %d, want 7", len(all))
		}
		b, _, _ := e.s.ListDeadLetters(e.ctx, store.DeadLetterQuery{Tenant: tenantB})
		if len(b) != 1 || b[0].Tenant != tenantB {
			e.t.Fatalf("tenant B list %+v", b)
		}
	},
	"Purge": func(e *env) {
		old := e.addDL(tenantA, "run-1", "0")
		e.clock.Advance(time.Hour)
		replayed := e.addDL(tenantA, "run-1", "1")
		keep := e.addDL(tenantA, "run-1", "2")
		other := e.addDL(tenantB, "run-2", "0")
		_, err := e.s.PurgeDeadLetters(e.ctx, store.PurgeQuery{Tenant: tenantA})
		wantErr(e.t, err, store.ErrInvalidArgument, "purge without a selector")
		if _, err := e.s.MarkReplayed(e.ctx, tenantA, replayed.ID); err != nil {
			e.t.Fatal(err)
		}
		// A time at or before the Unix epoch selects nothing (it must not read as "no
		// time filter").
		for _, at := range []time.Time{time.Unix(0, 0), time.Unix(-5, 0)} {
			if n, err := e.s.PurgeDeadLetters(e.ctx, store.PurgeQuery{Before: at}); err != nil || n != 0 {
				e.t.Fatalf("purge before %v: %d %v, want nothing purged", at, n, err)
			}
		}
		n, err := e.s.PurgeDeadLetters(e.ctx, store.PurgeQuery{Tenant: tenantA, OnlyReplayed: true})
		if err != nil || n != 1 {
			e.t.Fatalf("purge replayed: %d %v", n, err)
		}
		n, err = e.s.PurgeDeadLetters(e.ctx, store.PurgeQuery{Before: e.clock.Now().Add(-time.Minute)})
		if err != nil || n != 1 {
			e.t.Fatalf("purge old: %d %v", n, err)
		}
		if _, err := e.s.GetDeadLetter(e.ctx, "", old.ID); !errors.Is(err, store.ErrNotFound) {
			e.t.Fatalf("old dead letter survived: %v", err)
		}
		n, err = e.s.PurgeDeadLetters(e.ctx, store.PurgeQuery{Tenant: tenantB, ID: keep.ID})
		if err != nil || n != 0 {
			e.t.Fatalf("purge another tenant's by ID: %d %v", n, err)
		}
		n, err = e.s.PurgeDeadLetters(e.ctx, store.PurgeQuery{Tenant: tenantB, ID: other.ID})
		if err != nil || n != 1 {
			e.t.Fatalf("purge by ID: %d %v", n, err)
		}
		if _, err := e.s.GetDeadLetter(e.ctx, tenantA, keep.ID); err != nil {
			e.t.Fatalf("kept dead letter: %v", err)
		}
	},
}

var ledgerTests = map[string]func(*env){
	"SumPerRunAndNode": func(e *env) {
		add := func(le store.LedgerEntry, want bool) {
			e.t.Helper()
			added, err := e.s.AddTokens(e.ctx, le)
			if err != nil || (added == 1) != want {
				e.t.Fatalf("add %+v: added=%v %v, want %v", le, added, err, want)
			}
		}
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-1", NodeID: "root", Tokens: 120, Kind: "output", Key: "run-1/root/0",
			RetryID: "rid-1", Provider: "sim"}, true)
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-1", NodeID: "root", Tokens: 120, Kind: "output", Key: "run-1/root/0"}, false)
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-1", NodeID: "root", Tokens: 80}, true)
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-1", NodeID: "root", Tokens: 80}, true)
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-1", NodeID: "root/sub-1", Tokens: 400, At: e.clock.Now().Add(-time.Hour), Provider: "openai"}, true)
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-2", NodeID: "root", Tokens: 7}, true)
		add(store.LedgerEntry{Tenant: tenantB, RunID: "run-1", NodeID: "root", Tokens: 9, Key: "run-1/root/0"}, true)
		u, err := e.s.TokenUsage(e.ctx, tenantA, "run-1")
		if err != nil || u.Total != 680 || u.ByNode["root"] != 280 || u.ByNode["root/sub-1"] != 400 || len(u.ByNode) != 2 {
			e.t.Fatalf("usage %+v %v", u, err)
		}
		if u.ByProvider["sim"] != 120 || u.ByProvider["openai"] != 400 || u.ByProvider[""] != 160 || len(u.ByProvider) != 3 {
			e.t.Fatalf("usage by provider %+v", u.ByProvider)
		}
		if u.Prompt != 0 || len(u.PromptByNode) != 0 {
			e.t.Fatalf("prompt usage %+v without prompt entries", u)
		}
		// Prompt entries are summed apart from the output ones.
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-1", NodeID: "root", Tokens: 33, Kind: store.KindPrompt, Key: "run-1/root/0/prompt", Provider: "sim"}, true)
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-1", NodeID: "root/sub-1", Tokens: 5, Kind: store.KindPrompt, Provider: "openai"}, true)
		add(store.LedgerEntry{Tenant: tenantA, RunID: "run-1", NodeID: "root/sub-1", Tokens: 6, Kind: store.KindPrompt, Provider: "openai"}, true)
		u, err = e.s.TokenUsage(e.ctx, tenantA, "run-1")
		if err != nil || u.Total != 680 || u.ByNode["root"] != 280 || u.ByProvider["sim"] != 120 || u.ByProvider["openai"] != 400 {
			e.t.Fatalf("usage with prompt entries %+v %v: output figures must not change", u, err)
		}
		if u.Prompt != 44 || u.PromptByNode["root"] != 33 || u.PromptByNode["root/sub-1"] != 11 || len(u.PromptByNode) != 2 {
			e.t.Fatalf("prompt usage %+v, want 33 + 5 + 6", u)
		}
		u, _ = e.s.TokenUsage(e.ctx, tenantB, "run-1")
		if u.Total != 9 || u.Prompt != 0 {
			e.t.Fatalf("tenant B usage %+v", u)
		}
		u, err = e.s.TokenUsage(e.ctx, tenantA, "none")
		if err != nil || u.Total != 0 || len(u.ByNode) != 0 {
			e.t.Fatalf("usage of a run without entries %+v %v", u, err)
		}
		_, err = e.s.AddTokens(e.ctx, store.LedgerEntry{RunID: "r"})
		wantErr(e.t, err, store.ErrInvalidArgument, "entry without tenant")
	},
	"BatchInOneTransaction": func(e *env) {
		// Several entries at once: a key already stored, and one repeated within the
		// batch, are skipped; the rest are added.
		if n, err := e.s.AddTokens(e.ctx, store.LedgerEntry{Tenant: tenantA, RunID: "run-b", NodeID: "root", Tokens: 1, Key: "k0"}); err != nil || n != 1 {
			e.t.Fatalf("add k0: %d %v", n, err)
		}
		n, err := e.s.AddTokens(e.ctx,
			store.LedgerEntry{Tenant: tenantA, RunID: "run-b", NodeID: "root", Tokens: 10, Key: "k0"},
			store.LedgerEntry{Tenant: tenantA, RunID: "run-b", NodeID: "root/m1", Tokens: 20, Key: "k1"},
			store.LedgerEntry{Tenant: tenantA, RunID: "run-b", NodeID: "root/m1", Tokens: 20, Key: "k1"},
			store.LedgerEntry{Tenant: tenantA, RunID: "run-b", NodeID: "root/m2", Tokens: 30},
			store.LedgerEntry{Tenant: tenantB, RunID: "run-b", NodeID: "root", Tokens: 40, Key: "k0"},
		)
		if err != nil || n != 3 {
			e.t.Fatalf("batch: added %d %v, want 3 (k1 once, the keyless entry, tenant B's k0)", n, err)
		}
		u, err := e.s.TokenUsage(e.ctx, tenantA, "run-b")
		if err != nil || u.Total != 51 || u.ByNode["root"] != 1 || u.ByNode["root/m1"] != 20 || u.ByNode["root/m2"] != 30 {
			e.t.Fatalf("usage after the batch %+v %v, want 1 + 20 + 30", u, err)
		}
		// An invalid entry appends none of the batch.
		n, err = e.s.AddTokens(e.ctx,
			store.LedgerEntry{Tenant: tenantA, RunID: "run-b", NodeID: "root/m3", Tokens: 5},
			store.LedgerEntry{Tenant: tenantA, NodeID: "root/m4", Tokens: 5})
		wantErr(e.t, err, store.ErrInvalidArgument, "batch with an entry without run")
		if u, _ := e.s.TokenUsage(e.ctx, tenantA, "run-b"); n != 0 || u.Total != 51 {
			e.t.Fatalf("a failed batch added %d, usage %+v: want nothing added", n, u)
		}
		if n, err := e.s.AddTokens(e.ctx); err != nil || n != 0 {
			e.t.Fatalf("empty batch: %d %v", n, err)
		}
	},
}

var migrationTests = map[string]func(*env){
	"ReopenIsIdempotentAndKeepsData": func(e *env) {
		r := e.create(tenantA, "key", "")
		for range 2 {
			s := e.open()
			got, err := s.GetRun(e.ctx, tenantA, r.RunID)
			if err != nil || got.IdempotencyKey != "key" {
				e.t.Fatalf("run after reopening: %+v %v", got, err)
			}
		}
	},
	"ConcurrentOpensMigrateOnce": func(e *env) {
		dsn := e.fresh(e.t) // an empty database: four replicas start together
		var (
			mu   sync.Mutex
			errs []error
		)
		parallel(4, func(int) {
			s, err := store.Open(e.ctx, dsn, store.WithClock(e.clock.Now))
			if err == nil {
				err = s.Close()
			}
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
		if len(errs) > 0 {
			e.t.Fatalf("concurrent opens: %v", errs)
		}
	},
}
