package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// clusterBudget is the tenant's budget in TestBudgetAcrossReplicas: far below what the
// calls would spend together (80 calls of about 40 tokens).
const clusterBudget = 600

// Issue 24's acceptance for budgets: two modelproxy replicas on one PostgreSQL race for
// a tenant's last tokens, 40 callers with two model calls each, alternating between the
// replicas. Each replica alone would grant the whole budget; reserved in the store they
// grant it once: the ledger's total for the tenant (prompt + output, as `curfew usage`
// sums it) never passes the budget, and calls on both replicas were refused
// BUDGET_EXHAUSTED.
func TestBudgetAcrossReplicas(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	oc := newOpsBase(ctx, t, "budgets")
	c, st := oc.Cluster, oc.st
	adm := filepath.Join(c.Dir, "admission.json")
	writeFile(t, adm, fmt.Sprintf(`{"pools": [{"name": "paid", "max_in_flight": 8}],
	  "tenants": {"acme": {"token_budget": %d, "window": "1h"}}}`, clusterBudget))
	var (
		models []*meshproc.Proc
		mps    []modelproxyv1.ModelProxyServiceClient
	)
	for _, n := range []string{"modelproxy-a", "modelproxy-b"} {
		p, err := c.Add(ctx, "modelproxy", n, "--store", c.Store, "--admission-config", adm)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Start(ctx); err != nil {
			t.Fatalf("%s: %v", n, err)
		}
		conn, err := c.Conn(p)
		if err != nil {
			t.Fatal(err)
		}
		models = append(models, p)
		mps = append(mps, modelproxyv1.NewModelProxyServiceClient(conn))
	}

	// Each call decodes 30 tokens in about 150 ms, after a prompt of 6 words (tokens).
	const plan = `{"tokens_per_second": 200, "steps": [{"answer_tokens": 30}]}`
	var (
		wg                sync.WaitGroup
		granted, refused  [2]atomic.Int64
		otherErrs, tokens atomic.Int64
		mu                sync.Mutex
		firstErr          error
	)
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range 2 {
				r := (i + k) % 2
				cctx := metadata.AppendToOutgoingContext(ctx, md.Tenant, "acme", md.RunID, fmt.Sprintf("budget-run-%d", i),
					md.NodeID, fmt.Sprintf("root/m%d", k), md.RetryID, fmt.Sprintf("rid-%d-%d", i, k))
				n, err := generateAll(cctx, mps[r], plan)
				switch {
				case err == nil:
					granted[r].Add(1)
					tokens.Add(int64(n))
				case budget.Refused(err):
					refused[r].Add(1)
				default:
					if otherErrs.Add(1) == 1 {
						mu.Lock()
						firstErr = err
						mu.Unlock()
					}
				}
			}
		}()
	}
	wg.Wait()
	if n := otherErrs.Load(); n > 0 {
		t.Fatalf("%d calls failed otherwise than BUDGET_EXHAUSTED, first: %v", n, firstErr)
	}
	// A graceful stop writes each replica's last ledger entries.
	for _, p := range models {
		if err := p.Stop(10 * time.Second); err != nil {
			t.Errorf("%s stop: %v", p.Name, err)
		}
	}
	output, err := st.SumTokens(ctx, store.TokenQuery{Tenant: "acme"})
	if err != nil {
		t.Fatal(err)
	}
	prompt, err := st.SumTokens(ctx, store.TokenQuery{Tenant: "acme", Kind: store.KindPrompt})
	if err != nil {
		t.Fatal(err)
	}
	total := output + prompt
	t.Logf("granted %d + %d, refused %d + %d (replica a + b); the ledger's total for the tenant: %d (%d output + %d prompt) of %d; streamed %d",
		granted[0].Load(), granted[1].Load(), refused[0].Load(), refused[1].Load(), total, output, prompt, clusterBudget, tokens.Load())
	if total > clusterBudget {
		t.Errorf("the ledger's total for the tenant is %d, over its budget %d", total, clusterBudget)
	}
	if total < clusterBudget/2 || prompt == 0 {
		t.Errorf("the ledger's total is %d (%d prompt): the calls did not spend the budget, the test proves nothing", total, prompt)
	}
	for r := range 2 {
		if granted[r].Load() == 0 || refused[r].Load() == 0 {
			t.Errorf("replica %d granted %d and refused %d: want both on each replica", r, granted[r].Load(), refused[r].Load())
		}
	}
}

// generateAll calls Generate with plan as the user's message and reads the stream to its
// end, returning the tokens received.
func generateAll(ctx context.Context, mp modelproxyv1.ModelProxyServiceClient, plan string) (int, error) {
	st, err := mp.Generate(ctx, &modelproxyv1.GenerateRequest{Model: "sim",
		Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: plan}}})
	if err != nil {
		return 0, err
	}
	n := 0
	for {
		resp, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
		n += int(resp.GetTokens())
	}
}
