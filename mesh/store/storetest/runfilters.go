package storetest

import (
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// The filtered run lists (store.RunQuery's filters, migration 0012) are part of the
// Runs group.
func init() { maps.Copy(runTests, runFilterTests) }

const tenantC = "tenant-c"

// runFixture is a set of runs of three tenants, three models (one rare) and three
// statuses, created a minute apart by the store's clock, in creation order.
type runFixture struct {
	e    *env
	runs []store.Run
}

// newRunFixture creates n runs: run i is of tenant i%3, model i%4 ("m1", "m2", "m1",
// "rare") and, by i%5, pending, running, running, succeeded, failed.
func newRunFixture(e *env, n int) *runFixture {
	e.t.Helper()
	f := &runFixture{e: e}
	for i := range n {
		f.add([]string{tenantA, tenantB, tenantC}[i%3], []string{"m1", "m2", "m1", "rare"}[i%4], i%5)
		e.clock.Advance(time.Minute)
	}
	return f
}

// add creates one run of tenant and model, left pending (kind 0), running (1, 2),
// succeeded (3) or failed (4).
func (f *runFixture) add(tenant, model string, kind int) store.Run {
	e := f.e
	e.t.Helper()
	owner := ""
	if kind > 0 {
		owner = "orch-1"
	}
	r, _, err := e.s.CreateRun(e.ctx, store.NewRun{Tenant: tenant, Model: model, Task: []byte("t"),
		Deadline: e.clock.Now().Add(time.Hour), Owner: owner, LeaseTTL: time.Hour})
	if err != nil {
		e.t.Fatalf("create run: %v", err)
	}
	if kind >= 3 {
		res := store.RunResult{Status: store.StatusSucceeded}
		if kind == 4 {
			res = store.RunResult{Status: store.StatusFailed, Error: "x"}
		}
		if r, err = e.s.FinishRun(e.ctx, r.Lease(), res); err != nil {
			e.t.Fatalf("finish run: %v", err)
		}
	}
	f.runs = append(f.runs, r)
	return r
}

// want is what q selects, by the contract, of the fixture's runs: their IDs newest
// first.
func (f *runFixture) want(q store.RunQuery) []string {
	var ids []string
	for _, r := range f.runs {
		if (q.AllTenants || r.Tenant == q.Tenant) && (q.Status == "" || r.Status == q.Status) &&
			(q.Model == "" || r.Model == q.Model) &&
			(q.CreatedAfter.IsZero() || !r.CreatedAt.Before(q.CreatedAfter)) &&
			(q.CreatedBefore.IsZero() || r.CreatedAt.Before(q.CreatedBefore)) {
			ids = append(ids, r.RunID)
		}
	}
	slices.Sort(ids)
	slices.Reverse(ids)
	return ids
}

// list pages through q with pages of limit, checking that each page holds at most
// limit runs, each one q selects, and returns their IDs in the order listed.
func (f *runFixture) list(q store.RunQuery, limit int) []string {
	e := f.e
	e.t.Helper()
	q.Limit = limit
	var ids []string
	for page := 0; ; page++ {
		runs, next, err := e.s.ListRuns(e.ctx, q)
		if err != nil {
			e.t.Fatalf("list %+v: %v", q, err)
		}
		if len(runs) > limit || page > len(f.runs)+1 {
			e.t.Fatalf("list %+v: page %d has %d runs", q, page, len(runs))
		}
		for _, r := range runs {
			if !q.AllTenants && r.Tenant != q.Tenant {
				e.t.Fatalf("list of tenant %s holds run %s of tenant %s", q.Tenant, r.RunID, r.Tenant)
			}
			ids = append(ids, r.RunID)
		}
		if next == "" {
			return ids
		}
		if len(runs) == 0 || next != runs[len(runs)-1].RunID {
			e.t.Fatalf("list %+v: cursor %q is not the page's last run", q, next)
		}
		q.After = next
	}
}

// check lists q whole with pages of 1, 3 and 1000 and compares with want.
func (f *runFixture) check(what string, q store.RunQuery, wantN int) {
	f.e.t.Helper()
	want := f.want(q)
	if wantN >= 0 && len(want) != wantN {
		f.e.t.Fatalf("%s: the fixture has %d such runs, the test expects %d", what, len(want), wantN)
	}
	for _, limit := range []int{1, 3, 1000} {
		if got := f.list(q, limit); !slices.Equal(got, want) {
			f.e.t.Fatalf("%s (pages of %d): listed %d runs\n%s\nwant %d newest first\n%s",
				what, limit, len(got), strings.Join(got, "\n"), len(want), strings.Join(want, "\n"))
		}
	}
}

var runFilterTests = map[string]func(*env){
	"ListFilters": func(e *env) {
		f := newRunFixture(e, 60)
		t0 := f.runs[0].CreatedAt
		for _, c := range []struct {
			name string
			q    store.RunQuery
			n    int // how many the fixture holds, -1: not checked
		}{
			{"one tenant", store.RunQuery{Tenant: tenantA}, 20},
			{"every tenant", store.RunQuery{AllTenants: true}, 60},
			{"status", store.RunQuery{AllTenants: true, Status: store.StatusRunning}, 24},
			{"pending", store.RunQuery{AllTenants: true, Status: store.StatusPending}, 12},
			{"model", store.RunQuery{AllTenants: true, Model: "rare"}, 15},
			{"a model none has", store.RunQuery{AllTenants: true, Model: "nope"}, 0},
			{"created after", store.RunQuery{AllTenants: true, CreatedAfter: t0.Add(50 * time.Minute)}, 10},
			{"created before", store.RunQuery{AllTenants: true, CreatedBefore: t0.Add(10 * time.Minute)}, 10},
			{"window", store.RunQuery{AllTenants: true, CreatedAfter: t0.Add(20 * time.Minute), CreatedBefore: t0.Add(40 * time.Minute)}, 20},
			{"tenant and status", store.RunQuery{Tenant: tenantB, Status: store.StatusSucceeded}, 4},
			{"tenant and model", store.RunQuery{Tenant: tenantC, Model: "m1"}, 10},
			{"tenant and window", store.RunQuery{Tenant: tenantA, CreatedAfter: t0.Add(30 * time.Minute)}, 10},
			{"status and model", store.RunQuery{AllTenants: true, Status: store.StatusFailed, Model: "m2"}, 3},
			{"the rare model in a window", store.RunQuery{AllTenants: true, Model: "rare",
				CreatedAfter: t0.Add(15 * time.Minute), CreatedBefore: t0.Add(45 * time.Minute)}, 8},
			{"every filter", store.RunQuery{Tenant: tenantA, Status: store.StatusRunning, Model: "m1",
				CreatedAfter: t0.Add(5 * time.Minute), CreatedBefore: t0.Add(55 * time.Minute)}, -1},
			{"every filter, no match", store.RunQuery{Tenant: tenantA, Status: store.StatusPending, Model: "rare",
				CreatedAfter: t0.Add(time.Minute), CreatedBefore: t0.Add(2 * time.Minute)}, 0},
		} {
			f.check(c.name, c.q, c.n)
		}
	},
	"ListWindowBounds": func(e *env) {
		// [CreatedAfter, CreatedBefore): the lower bound inclusive, the upper exclusive,
		// compared at the millisecond.
		f := newRunFixture(e, 10)
		at := func(i int) time.Time { return f.runs[i].CreatedAt }
		only := func(what string, q store.RunQuery, want ...int) {
			e.t.Helper()
			q.AllTenants = true
			got := f.list(q, 100)
			var ids []string
			for _, i := range slices.Backward(want) {
				ids = append(ids, f.runs[i].RunID)
			}
			if !slices.Equal(got, ids) {
				e.t.Fatalf("%s: listed %v, want runs %v (%v)", what, got, want, ids)
			}
		}
		only("after run 3's instant", store.RunQuery{CreatedAfter: at(3), CreatedBefore: at(5)}, 3, 4)
		only("a nanosecond after it", store.RunQuery{CreatedAfter: at(3).Add(time.Nanosecond), CreatedBefore: at(5)}, 4)
		only("a millisecond before it", store.RunQuery{CreatedAfter: at(3).Add(-time.Millisecond), CreatedBefore: at(5)}, 3, 4)
		only("before run 5's instant", store.RunQuery{CreatedAfter: at(3), CreatedBefore: at(5).Add(time.Nanosecond)}, 3, 4, 5)
		only("one run's instant to a millisecond later", store.RunQuery{CreatedAfter: at(7), CreatedBefore: at(7).Add(time.Millisecond)}, 7)
		only("equal bounds", store.RunQuery{CreatedAfter: at(7), CreatedBefore: at(7)})
		only("before the first", store.RunQuery{CreatedBefore: at(0)})
		only("after the last", store.RunQuery{CreatedAfter: at(9).Add(time.Millisecond)})
	},
	"ListTenantIsolation": func(e *env) {
		// A tenant's query, whatever its filters, never sees another tenant's runs; the
		// operators' query sees every tenant's.
		f := newRunFixture(e, 30)
		seen := map[string]bool{}
		for _, tenant := range []string{tenantA, tenantB, tenantC, "tenant-none"} {
			for _, q := range []store.RunQuery{
				{Tenant: tenant}, {Tenant: tenant, Model: "rare"}, {Tenant: tenant, Status: store.StatusRunning},
				{Tenant: tenant, CreatedAfter: f.runs[10].CreatedAt},
			} {
				f.check("tenant "+tenant, q, -1) // list fails on a run of another tenant
			}
			for _, id := range f.list(store.RunQuery{Tenant: tenant}, 7) {
				seen[id] = true
			}
		}
		all := f.list(store.RunQuery{AllTenants: true}, 7)
		if len(all) != 30 || len(seen) != 30 {
			e.t.Fatalf("every tenant's list has %d runs, the tenants' lists %d; want all 30", len(all), len(seen))
		}
		tenants := map[string]bool{}
		runs, _, err := e.s.ListRuns(e.ctx, store.RunQuery{AllTenants: true, Model: "m2"})
		if err != nil {
			e.t.Fatal(err)
		}
		for _, r := range runs {
			tenants[r.Tenant] = true
		}
		if len(tenants) != 3 {
			e.t.Fatalf("every tenant's list of model m2 has the runs of tenants %v, want 3", tenants)
		}
	},
	"ListPagesWhileRunsChange": func(e *env) {
		// Runs created, ended or deleted between two pages of a filtered list: the pages
		// continue after the cursor, without duplicates or gaps, even when the cursor's
		// run itself is gone.
		f := newRunFixture(e, 30)
		q := store.RunQuery{AllTenants: true, Model: "m1", Limit: 4}
		first, next, err := e.s.ListRuns(e.ctx, q)
		if err != nil || len(first) != 4 || next == "" {
			e.t.Fatalf("first page: %d runs, next %q, %v", len(first), next, err)
		}
		before := f.want(store.RunQuery{AllTenants: true, Model: "m1"})
		f.add(tenantA, "m1", 3) // newer than the cursor: on no later page
		cursor := first[3]
		if !cursor.Status.Terminal() {
			if _, err := e.s.FinishRun(e.ctx, cursor.Lease(), store.RunResult{Status: store.StatusCancelled}); err != nil {
				e.t.Fatal(err)
			}
		}
		if err := e.s.DeleteRun(e.ctx, cursor.Tenant, cursor.RunID); err != nil {
			e.t.Fatal(err)
		}
		for _, r := range f.runs[:len(f.runs)-1] {
			if r.RunID < cursor.RunID && r.Model == "m1" && !r.Status.Terminal() {
				// A run on a later page ends: it is still listed, with its new status.
				if _, err := e.s.FinishRun(e.ctx, r.Lease(), store.RunResult{Status: store.StatusSucceeded}); err != nil {
					e.t.Fatal(err)
				}
				break
			}
		}
		got := []string{first[0].RunID, first[1].RunID, first[2].RunID, first[3].RunID}
		q.After = next
		got = append(got, f.list(q, 4)...)
		if !slices.Equal(got, before) {
			e.t.Fatalf("pages across the changes: %v\nwant the runs as listed at the first page: %v", got, before)
		}
	},
	"ListValidates": func(e *env) {
		f := newRunFixture(e, 3)
		now := e.clock.Now()
		for _, c := range []struct {
			what string
			q    store.RunQuery
		}{
			{"no tenant", store.RunQuery{}},
			{"no tenant, with filters", store.RunQuery{Model: "m1", Status: store.StatusRunning}},
			{"a tenant and every tenant", store.RunQuery{Tenant: tenantA, AllTenants: true}},
			{"a negative limit", store.RunQuery{Tenant: tenantA, Limit: -1}},
			{"an unknown status", store.RunQuery{Tenant: tenantA, Status: "lost"}},
			{"an inverted window", store.RunQuery{AllTenants: true, CreatedAfter: now, CreatedBefore: now.Add(-time.Nanosecond)}},
		} {
			_, _, err := e.s.ListRuns(e.ctx, c.q)
			wantErr(e.t, err, store.ErrInvalidArgument, c.what)
		}
		// Limits: 0 is the default page (100), above 1000 is 1000.
		for _, limit := range []int{0, 1000, 5000} {
			runs, next, err := e.s.ListRuns(e.ctx, store.RunQuery{AllTenants: true, Limit: limit})
			if err != nil || len(runs) != len(f.runs) || next != "" {
				e.t.Fatalf("limit %d: %d runs, next %q, %v; want all %d on one page", limit, len(runs), next, err, len(f.runs))
			}
		}
	},
}
