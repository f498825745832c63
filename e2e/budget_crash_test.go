package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Issue 26 item 4 for budgets, on real processes: a modelproxy replica is SIGKILLed while
// it streams a call under a tenant's token budget, and the call is retried on the other
// replica (same retry-id, next attempt). The killed attempt's reservation is never
// settled; when it lapses (TTL after the dead replica's last renewal) the tenant's
// window is charged what the ledger has of that attempt (the parts its decoder persisted
// before the kill), beside the retry's settled spend: the window's spend ends equal to
// the ledger's total for the run, every attempt counted once. Then a later call's
// reservation (which lapses the hold in the store) adds only its own spend. Without the
// charge, the window shows the retry alone and the killed attempt's tokens are hidden.
func TestBudgetChargesACrashedReplicasSpend(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	oc := newOpsBase(ctx, t, "budget-crash")
	c, st := oc.Cluster, oc.st
	adm := filepath.Join(c.Dir, "admission.json")
	writeFile(t, adm, `{"pools": [{"name": "paid", "max_in_flight": 8}],
	  "tenants": {"acme": {"token_budget": 100000, "window": "1h"}}}`)
	models, mps := budgetReplicas(ctx, t, c, adm)

	// 300 tokens at 100 a second: a 3 s stream, which the kill cuts after about a second.
	const (
		plan  = `{"tokens_per_second": 100, "steps": [{"answer_tokens": 300}]}`
		run   = "crash-budget-run"
		short = `{"tokens_per_second": 1000, "steps": [{"answer_tokens": 5}]}`
	)
	attempt := func(n int) context.Context {
		return metadata.AppendToOutgoingContext(ctx, md.Tenant, "acme", md.RunID, run, md.NodeID, "root/m0",
			md.RetryID, "crash-rid", md.Attempt, fmt.Sprint(n))
	}
	// ledger is the run's spend in the durable ledger, every kind (prompt too), as the
	// budget counts it.
	ledger := func(run string) int64 {
		t.Helper()
		output, err := st.SumTokens(ctx, store.TokenQuery{Tenant: "acme", RunID: run})
		if err != nil {
			t.Fatal(err)
		}
		prompt, err := st.SumTokens(ctx, store.TokenQuery{Tenant: "acme", RunID: run, Kind: store.KindPrompt})
		if err != nil {
			t.Fatal(err)
		}
		return output + prompt
	}
	usage := func() store.TokenBudgetState {
		t.Helper()
		u, err := st.TokenBudgetUsage(ctx, "acme", time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		return u
	}

	// Attempt 1 on replica a, killed once its decoder has persisted parts.
	type result struct {
		n   int
		err error
	}
	first := make(chan result, 1)
	go func() {
		n, err := generateAll(attempt(1), mps[0], plan)
		first <- result{n, err}
	}()
	waitFor(t, "the first attempt's parts in the ledger", 30*time.Second, func() bool { return ledger(run) >= 50 })
	if err := models[0].Kill(); err != nil {
		t.Fatal(err)
	}
	cut := <-first
	if cut.err == nil {
		t.Fatalf("the first attempt ended without error (%d tokens) although its replica was killed", cut.n)
	}
	killed := ledger(run) // a dead process appends nothing more
	if u := usage(); u.Reserved <= 0 {
		t.Fatalf("usage %+v right after the kill: want the killed attempt's hold still reserved", u)
	}

	// Attempt 2 on replica b: the whole step, settled normally.
	got, err := generateAll(attempt(2), mps[1], plan)
	if err != nil || got != 300 {
		t.Fatalf("the retry on the other replica: %d tokens, %v; want 300", got, err)
	}
	// The retry's last part reaches the ledger within the persister's delay.
	var retry int64
	waitFor(t, "the retry's spend in the ledger", 10*time.Second, func() bool {
		retry = ledger(run) - killed
		return retry > 300
	})

	// The killed attempt's hold lapses within the TTL of the dead replica's last renewal.
	var u store.TokenBudgetState
	lapsed := waitFor(t, "the killed attempt's hold lapsed", budget.DefaultTTL+20*time.Second, func() bool {
		u = usage()
		return u.Reserved == 0
	})
	t.Logf("killed after %d tokens streamed; the ledger has %d of the killed attempt and %d of the retry; the window: spent %d, reserved %d (hold lapsed %v after the retry)",
		cut.n, killed, retry, u.Spent, u.Reserved, lapsed.Round(100*time.Millisecond))
	if want := killed + retry; u.Spent != want {
		t.Fatalf("the window's spend is %d, want %d: the killed attempt's ledger spend %d plus the retry's %d, each once",
			u.Spent, want, killed, retry)
	}
	if killed >= 300 {
		t.Fatalf("the killed attempt's ledger spend is %d: the kill did not land mid-stream", killed)
	}

	// A later call's reservation lapses the hold in the store: its charge stays once, and
	// the call adds its own spend only.
	later := metadata.AppendToOutgoingContext(ctx, md.Tenant, "acme", md.RunID, run+"-later", md.NodeID, "root/m0",
		md.RetryID, "later-rid")
	if _, err := generateAll(later, mps[1], short); err != nil {
		t.Fatal(err)
	}
	var after store.TokenBudgetState
	waitFor(t, "the later call's spend in the ledger", 10*time.Second, func() bool {
		after = usage()
		return ledger(run+"-later") > 0 && after.Reserved == 0
	})
	if want := u.Spent + ledger(run+"-later"); after.Spent != want {
		t.Fatalf("the window's spend after a later call is %d, want %d (%d before + the call's %d)",
			after.Spent, want, u.Spent, ledger(run+"-later"))
	}
}
