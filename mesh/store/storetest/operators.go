package storetest

import (
	"errors"
	"slices"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

func (e *env) put(s store.Store, c store.Control) (store.Control, bool) {
	e.t.Helper()
	out, created, err := s.PutControl(e.ctx, c)
	if err != nil {
		e.t.Fatalf("put control %+v: %v", c, err)
	}
	return out, created
}

func (e *env) tokens(es ...store.LedgerEntry) {
	e.t.Helper()
	if _, err := e.s.AddTokens(e.ctx, es...); err != nil {
		e.t.Fatalf("add tokens: %v", err)
	}
}

var operatorTests = map[string]func(*env){
	"ControlsHoldOnEveryReplicaAndRepeatSafely": func(e *env) {
		first := e.clock.Now()
		c, created := e.put(e.s, store.Control{Kind: store.ControlPoolClosed, Target: "overflow", Reason: "orphans", Actor: "mesh:curfew-cli"})
		if !created || c.Reason != "orphans" || !c.CreatedAt.Equal(first) {
			e.t.Fatalf("first put: %+v created=%v", c, created)
		}
		// Repeating it through another replica keeps the first decision's time and actor.
		e.clock.Advance(time.Minute)
		other := e.open()
		c, created = e.put(other, store.Control{Kind: store.ControlPoolClosed, Target: "overflow", Reason: "still orphans", Actor: "key:other"})
		if created || !c.CreatedAt.Equal(first) || c.Actor != "mesh:curfew-cli" || c.Reason != "still orphans" {
			e.t.Fatalf("repeated put: %+v created=%v", c, created)
		}
		until := e.clock.Now().Add(time.Hour)
		e.put(e.s, store.Control{Kind: store.ControlFreezeRun, Target: "run-1", Tenant: tenantA, Actor: "a"})
		e.put(e.s, store.Control{Kind: store.ControlDrain, Target: store.DrainAll, Actor: "a", Until: until})
		got, err := other.ListControls(e.ctx)
		if err != nil || len(got) != 3 {
			e.t.Fatalf("list from another replica: %+v, %v", got, err)
		}
		kinds := []store.ControlKind{got[0].Kind, got[1].Kind, got[2].Kind}
		if !slices.Equal(kinds, []store.ControlKind{store.ControlDrain, store.ControlFreezeRun, store.ControlPoolClosed}) {
			e.t.Fatalf("order: %v", kinds)
		}
		if !got[0].Until.Equal(until) || got[1].Tenant != tenantA {
			e.t.Fatalf("fields: %+v", got)
		}
		old, deleted, err := other.DeleteControl(e.ctx, store.ControlPoolClosed, "overflow")
		if err != nil || !deleted || old.Reason != "still orphans" {
			e.t.Fatalf("delete: %+v %v %v", old, deleted, err)
		}
		if _, deleted, err := e.s.DeleteControl(e.ctx, store.ControlPoolClosed, "overflow"); err != nil || deleted {
			e.t.Fatalf("delete again: %v %v", deleted, err)
		}
		if got, _ := e.s.ListControls(e.ctx); len(got) != 2 {
			e.t.Fatalf("after delete: %+v", got)
		}
		if _, _, err := e.s.PutControl(e.ctx, store.Control{Kind: store.ControlPoolClosed}); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("control without target: %v", err)
		}
	},
	"AuditPagesNewestFirst": func(e *env) {
		start := e.clock.Now()
		for i := range 5 {
			a, err := e.s.AddAudit(e.ctx, store.AuditEntry{Actor: "mesh:curfew-cli", Action: "ClosePool", Target: "pool overflow",
				Reason: string(rune('a' + i)), Request: `{"pool":"overflow"}`})
			if err != nil || a.ID == 0 || !a.At.Equal(e.clock.Now()) {
				e.t.Fatalf("add %d: %+v %v", i, a, err)
			}
			e.clock.Advance(time.Second)
		}
		page, next, err := e.open().ListAudit(e.ctx, store.AuditQuery{Limit: 2})
		if err != nil || len(page) != 2 || next == "" || page[0].Reason != "e" || page[1].Reason != "d" {
			e.t.Fatalf("page 1: %+v %q %v", page, next, err)
		}
		page, next, err = e.s.ListAudit(e.ctx, store.AuditQuery{Limit: 2, After: next})
		if err != nil || len(page) != 2 || page[0].Reason != "c" || page[1].Reason != "b" {
			e.t.Fatalf("page 2: %+v %q %v", page, next, err)
		}
		page, next, err = e.s.ListAudit(e.ctx, store.AuditQuery{Limit: 2, After: next})
		if err != nil || len(page) != 1 || next != "" || page[0].Reason != "a" || page[0].Request != `{"pool":"overflow"}` {
			e.t.Fatalf("page 3: %+v %q %v", page, next, err)
		}
		if page, _, _ := e.s.ListAudit(e.ctx, store.AuditQuery{Since: start.Add(3 * time.Second)}); len(page) != 2 {
			e.t.Fatalf("since: %+v", page)
		}
		if _, _, err := e.s.ListAudit(e.ctx, store.AuditQuery{After: "x"}); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("bad cursor: %v", err)
		}
		if _, err := e.s.AddAudit(e.ctx, store.AuditEntry{Action: "ClosePool"}); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("no actor: %v", err)
		}
	},
	"KeyScopesAndRunStarter": func(e *env) {
		k, _, err := e.s.CreateAPIKey(e.ctx, store.APIKey{ID: "op", Tenant: "ops", Hash: []byte("h"),
			Scopes: []string{store.ScopeAdmin, store.ScopeReadOnly}}, false)
		if err != nil || !slices.Equal(k.Scopes, []string{store.ScopeAdmin, store.ScopeReadOnly}) {
			e.t.Fatalf("create: %+v %v", k, err)
		}
		if got, _ := e.open().GetAPIKey(e.ctx, "op"); !slices.Equal(got.Scopes, k.Scopes) {
			e.t.Fatalf("get: %+v", got)
		}
		if plain, _ := e.addKey("plain", tenantA, false); plain.Scopes != nil {
			e.t.Fatalf("plain key has scopes %v", plain.Scopes)
		}
		if _, _, err := e.s.CreateAPIKey(e.ctx, store.APIKey{ID: "bad", Tenant: "t", Hash: []byte("h"), Scopes: []string{"root"}}, false); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("bad scope: %v", err)
		}
		r, _, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, Deadline: e.clock.Now().Add(time.Minute), StartedBy: "key:plain"})
		if err != nil || r.StartedBy != "key:plain" {
			e.t.Fatalf("create run: %+v %v", r, err)
		}
		if got, _ := e.open().GetRun(e.ctx, tenantA, r.RunID); got.StartedBy != "key:plain" {
			e.t.Fatalf("get run: %+v", got)
		}
	},
	"UsageAndTokenSums": func(e *env) {
		t0 := e.clock.Now()
		e.tokens(store.LedgerEntry{Tenant: tenantA, RunID: "r1", NodeID: "root", Tokens: 10, Kind: store.KindPrompt},
			store.LedgerEntry{Tenant: tenantA, RunID: "r1", NodeID: "root", Tokens: 5},
			store.LedgerEntry{Tenant: tenantB, RunID: "r2", NodeID: "root", Tokens: 7})
		if _, _, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, Deadline: t0.Add(time.Hour)}); err != nil {
			e.t.Fatal(err)
		}
		if err := e.s.AddSheds(e.ctx, tenantA, time.Time{}, 2); err != nil {
			e.t.Fatal(err)
		}
		e.clock.Advance(2 * time.Minute)
		t1 := e.clock.Now()
		e.tokens(store.LedgerEntry{Tenant: tenantA, RunID: "r1", NodeID: "root", Tokens: 3, Kind: store.KindOrphan},
			store.LedgerEntry{Tenant: tenantA, RunID: "r3", NodeID: "root", Tokens: 4})
		if _, _, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenantA, Deadline: t1.Add(time.Hour)}); err != nil {
			e.t.Fatal(err)
		}
		if err := e.open().AddSheds(e.ctx, tenantA, t1, 1); err != nil {
			e.t.Fatal(err)
		}
		if err := e.s.AddSheds(e.ctx, tenantA, t1, 1); err != nil {
			e.t.Fatal(err)
		}
		all, err := e.s.TenantUsage(e.ctx, "", time.Time{})
		want := []store.TenantUsage{
			{Tenant: tenantA, Prompt: 10, Output: 12, Orphan: 3, Runs: 2, Sheds: 4},
			{Tenant: tenantB, Output: 7},
		}
		if err != nil || !slices.Equal(all, want) {
			e.t.Fatalf("usage: %+v %v, want %+v", all, err, want)
		}
		recent, err := e.s.TenantUsage(e.ctx, tenantA, t1)
		if err != nil || !slices.Equal(recent, []store.TenantUsage{{Tenant: tenantA, Output: 7, Orphan: 3, Runs: 1, Sheds: 2}}) {
			e.t.Fatalf("usage since: %+v %v", recent, err)
		}
		sums := []struct {
			q    store.TokenQuery
			want int64
		}{
			{store.TokenQuery{}, 19},
			{store.TokenQuery{Kind: store.KindOrphan}, 3},
			{store.TokenQuery{Kind: store.KindOrphan, Since: t1}, 0}, // strictly after
			{store.TokenQuery{Kind: store.KindOrphan, Since: t0}, 3},
			{store.TokenQuery{Tenant: tenantA, RunID: "r1"}, 8},
			{store.TokenQuery{Tenant: tenantA, Since: t0}, 7},
			{store.TokenQuery{Kind: store.KindPrompt}, 10},
		}
		for _, c := range sums {
			if n, err := e.s.SumTokens(e.ctx, c.q); err != nil || n != c.want {
				e.t.Errorf("sum %+v = %d, %v; want %d", c.q, n, err, c.want)
			}
		}
		if err := e.s.AddSheds(e.ctx, "", t1, 1); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Fatalf("sheds without tenant: %v", err)
		}
	},
}
