package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
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
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// clusterBudget is the tenant's budget in TestBudgetAcrossReplicas: far below what the
// calls would spend together (80 calls of about 40 tokens).
const clusterBudget = 600

// Issue 24's acceptance for budgets: two modelproxy replicas on one PostgreSQL race for
// a tenant's last tokens, 40 callers with two model calls each, alternating between the
// replicas. Each replica alone would grant the whole budget; reserved in the store they
// grant it once: the ledger's total for the tenant (prompt + output, as `curfew usage`
// sums it) never passes the budget, and calls on both replicas were refused
// BUDGET_EXHAUSTED. (With each replica counting alone, the total reaches 1190.)
func TestBudgetAcrossReplicas(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	oc := newOpsBase(ctx, t, "budgets")
	c, st := oc.Cluster, oc.st
	adm := filepath.Join(c.Dir, "admission.json")
	writeFile(t, adm, fmt.Sprintf(`{"pools": [{"name": "paid", "max_in_flight": 8}],
	  "tenants": {"acme": {"token_budget": %d, "window": "1h"}}}`, clusterBudget))
	models, mps := budgetReplicas(ctx, t, c, adm)

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
	// Which replica wins each race is up to the store (one may win most); both must have
	// refused, having seen the budget the other spent.
	for r := range 2 {
		if refused[r].Load() == 0 {
			t.Errorf("replica %d granted %d and refused none: want refusals on each replica", r, granted[r].Load())
		}
	}
	if granted[0].Load()+granted[1].Load() == 0 {
		t.Error("no call was granted")
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

// tcpProxy forwards a port to PostgreSQL, and can be cut (the listener and every
// connection closed, as a stopped server or a partition would) and restored on the same
// port: the store's outage, for processes that cannot be told.
type tcpProxy struct {
	target string
	addr   string

	mu    sync.Mutex
	l     net.Listener
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

func startProxy(t *testing.T, target string) *tcpProxy {
	t.Helper()
	p := &tcpProxy{target: target, addr: "127.0.0.1:0", conns: map[net.Conn]struct{}{}}
	if err := p.listen(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.cut(); p.wg.Wait() })
	return p
}

func (p *tcpProxy) listen() error {
	l, err := net.Listen("tcp", p.addr)
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.l, p.addr = l, l.Addr().String()
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", p.target)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.conns[c], p.conns[up] = struct{}{}, struct{}{}
			p.mu.Unlock()
			for _, pair := range [][2]net.Conn{{c, up}, {up, c}} {
				p.wg.Add(1)
				go func() {
					defer p.wg.Done()
					_, _ = io.Copy(pair[0], pair[1])
					_ = pair[0].Close()
					_ = pair[1].Close()
				}()
			}
		}
	}()
	return nil
}

// cut closes the listener and every connection.
func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.l != nil {
		_ = p.l.Close()
		p.l = nil
	}
	for c := range p.conns {
		_ = c.Close()
	}
	clear(p.conns)
}

// budgetCoordination is the budget part of mp's ListDecoders coordination (nil if none).
func budgetCoordination(ctx context.Context, t *testing.T, mp modelproxyv1.ModelProxyServiceClient) *modelproxyv1.Coordination {
	t.Helper()
	resp, err := mp.ListDecoders(ctx, &modelproxyv1.ListDecodersRequest{})
	if err != nil {
		t.Fatalf("ListDecoders: %v", err)
	}
	for _, c := range resp.GetCoordination() {
		if c.GetPart() == "budget" {
			return c
		}
	}
	return nil
}

// degradedGauge reads curfew_budget_coordination_degraded from p's /metrics (-1 when
// absent).
func degradedGauge(t *testing.T, p *meshproc.Proc) float64 {
	t.Helper()
	resp, err := http.Get("http://" + p.AdminAddr + "/metrics")
	if err != nil {
		t.Fatalf("%s metrics: %v", p.Name, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "curfew_budget_coordination_degraded "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	return -1
}

// Issue 24's item 6 for budgets, on real processes: the store (PostgreSQL behind a
// proxy the test cuts) is unreachable for 10 s while two modelproxy replicas serve a
// tenant. Meanwhile both keep serving against their share of what was left (half each),
// say so in curfew_budget_coordination_degraded, and refuse past it; when the store is
// back both coordinate again, and the store's spend for the tenant includes every call
// served during the outage and never passes the budget.
func TestBudgetStoreOutage(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dsn := storetest.PostgresDSN(t)
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatal(err)
	}
	proxy := startProxy(t, u.Host)
	u.Host = proxy.addr
	dir, err := os.MkdirTemp("", "curfew-budget-outage-")
	if err != nil {
		t.Fatal(err)
	}
	c, err := meshproc.NewCluster(ctx, dir, u.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = c.Close()
		if t.Failed() {
			t.Logf("process logs are in %s", dir)
		} else {
			_ = os.RemoveAll(dir)
		}
	})
	st, err := store.Open(ctx, dsn) // directly, not through the proxy
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	const budgetTokens = 3000
	adm := filepath.Join(dir, "admission.json")
	writeFile(t, adm, fmt.Sprintf(`{"pools": [{"name": "paid", "max_in_flight": 8}],
	  "tenants": {"acme": {"token_budget": %d, "window": "1h"}}}`, budgetTokens))
	models, mps := budgetReplicas(ctx, t, c, adm)
	const plan = `{"tokens_per_second": 1000, "steps": [{"answer_tokens": 30}]}`
	// A plan no budget covers: its refusal tells a replica the tenant's latest figures.
	const huge = `{"tokens_per_second": 1000, "steps": [{"answer_tokens": 100000}]}`
	seq := atomic.Int64{}
	call := func(r int, p string) error {
		i := seq.Add(1)
		cctx := metadata.AppendToOutgoingContext(ctx, md.Tenant, "acme", md.RunID, fmt.Sprintf("outage-run-%d", i),
			md.NodeID, "root/m0", md.RetryID, fmt.Sprintf("rid-%d", i))
		_, err := generateAll(cctx, mps[r], p)
		return err
	}
	// Coordinated: 10 calls, then a refused one on each replica.
	for i := range 10 {
		if err := call(i%2, plan); err != nil {
			t.Fatalf("call %d before the outage: %v", i, err)
		}
	}
	for r := range 2 {
		if err := call(r, huge); !budget.Refused(err) {
			t.Fatalf("a call over the whole budget on replica %d: %v, want BUDGET_EXHAUSTED", r, err)
		}
	}
	before, err := st.TokenBudgetUsage(ctx, "acme", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	perCall := before.Spent / 10
	// Both replicas have counted each other in store.Replicas by their first renewal tick.
	time.Sleep(4 * time.Second)

	proxy.cut()
	cutAt := time.Now()
	var (
		wg               sync.WaitGroup
		granted, refused [2]atomic.Int64
		others           atomic.Int64
	)
	for g := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := range 3 {
				r := (g + k) % 2
				switch err := call(r, plan); {
				case err == nil:
					granted[r].Add(1)
				case budget.Refused(err):
					refused[r].Add(1)
				default:
					others.Add(1)
					t.Logf("call on replica %d during the outage: %v", r, err)
				}
			}
		}()
	}
	wg.Wait()
	for r, p := range models {
		if g := degradedGauge(t, p); g != 1 {
			t.Errorf("%s: curfew_budget_coordination_degraded = %v during the outage, want 1", p.Name, g)
		}
		if c := budgetCoordination(ctx, t, mps[r]); !c.GetDegraded() || c.GetSince() == nil || !strings.Contains(c.GetDetail(), "this replica's share") {
			t.Errorf("%s: ListDecoders's budget coordination %v during the outage, want degraded, since when, on its share", p.Name, c)
		}
		if granted[r].Load() == 0 || refused[r].Load() == 0 {
			t.Errorf("%s granted %d and refused %d during the outage: want both (served, then its share used up)",
				p.Name, granted[r].Load(), refused[r].Load())
		}
	}
	if n := others.Load(); n > 0 {
		t.Errorf("%d calls failed otherwise than BUDGET_EXHAUSTED during the outage", n)
	}
	share := (budgetTokens - before.Spent) / 2
	for r := range 2 {
		if spent := granted[r].Load() * perCall; spent > share {
			t.Errorf("replica %d spent %d during the outage, over its share %d", r, spent, share)
		}
	}
	time.Sleep(time.Until(cutAt.Add(10 * time.Second)))
	if err := proxy.listen(); err != nil {
		t.Fatalf("restoring the store: %v", err)
	}
	restored := time.Now()
	waitFor(t, "coordination resumed on both replicas", 20*time.Second, func() bool {
		return degradedGauge(t, models[0]) == 0 && degradedGauge(t, models[1]) == 0
	})
	resumed := time.Since(restored)
	for r, p := range models {
		if c := budgetCoordination(ctx, t, mps[r]); c.GetDegraded() || !strings.Contains(c.GetDetail(), "reservations in the store") {
			t.Errorf("%s: ListDecoders's budget coordination %v after the store came back, want coordinated", p.Name, c)
		}
	}
	after, err := st.TokenBudgetUsage(ctx, "acme", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	served := granted[0].Load() + granted[1].Load()
	t.Logf("before the outage: %d spent of %d (%d per call); during it: granted %d + %d, refused %d + %d (shares of %d); coordination resumed %v after the store; the store's spend now %d, reserved %d",
		before.Spent, budgetTokens, perCall, granted[0].Load(), granted[1].Load(), refused[0].Load(), refused[1].Load(), share,
		resumed.Round(time.Millisecond), after.Spent, after.Reserved)
	if want := before.Spent + served*perCall; after.Spent != want {
		t.Errorf("the store's spend after the outage is %d, want %d: the calls served during it charged", after.Spent, want)
	}
	if after.Spent > budgetTokens || after.Reserved != 0 {
		t.Errorf("the store's spend %d (reserved %d) passes the budget %d", after.Spent, after.Reserved, budgetTokens)
	}
	// Coordinated again: the store's figures decide, on either replica.
	left := budgetTokens - after.Spent
	for r := range 2 {
		err := call(r, plan)
		if left >= perCall && err != nil {
			t.Errorf("replica %d after the outage with %d left: %v", r, left, err)
		}
		if left < perCall && !budget.Refused(err) {
			t.Errorf("replica %d after the outage with %d left: %v, want BUDGET_EXHAUSTED", r, left, err)
		}
		left -= perCall
	}
}

// budgetReplicas starts two modelproxy replicas on the cluster's store with the
// admission file adm (the tenants' budgets), and dials each.
func budgetReplicas(ctx context.Context, t *testing.T, c *meshproc.Cluster, adm string) ([]*meshproc.Proc, []modelproxyv1.ModelProxyServiceClient) {
	t.Helper()
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
	return models, mps
}
