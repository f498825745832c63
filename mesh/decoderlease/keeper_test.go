package decoderlease_test

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/decoderlease"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// renewal is one RenewLeases call the fake received.
type renewal struct {
	at     time.Time
	tenant string
	keys   []string // run/node/retry
	ttl    time.Duration
}

// proxy is a ModelProxyService that records RenewLeases calls and says the keys of the
// runs in unknown are unknown.
type proxy struct {
	modelproxyv1.UnimplementedModelProxyServiceServer
	unknown map[string]bool
	mu      sync.Mutex
	calls   []renewal
}

func (p *proxy) RenewLeases(ctx context.Context, req *modelproxyv1.RenewLeasesRequest) (*modelproxyv1.RenewLeasesResponse, error) {
	r := renewal{at: time.Now(), tenant: md.IdentityFrom(ctx).Tenant, ttl: req.GetTtl().AsDuration()}
	resp := &modelproxyv1.RenewLeasesResponse{}
	for _, k := range req.GetKeys() {
		r.keys = append(r.keys, k.GetRunId()+"/"+k.GetNodeId()+"/"+k.GetRetryId())
		if p.unknown[k.GetRunId()] {
			resp.Unknown = append(resp.Unknown, k)
		}
	}
	p.mu.Lock()
	p.calls = append(p.calls, r)
	p.mu.Unlock()
	return resp, nil
}

func (p *proxy) renewals() []renewal {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.calls)
}

// serve serves p over real gRPC with the mesh chains and returns a client of it.
func serve(t *testing.T, p *proxy) modelproxyv1.ModelProxyServiceClient {
	cc := meshtest.Serve(t, mesh.ServerConfig{}, func(s *grpc.Server) { modelproxyv1.RegisterModelProxyServiceServer(s, p) })
	return modelproxyv1.NewModelProxyServiceClient(cc)
}

func callCtx(t *testing.T, tenant, run string, timeout time.Duration) context.Context {
	ctx := md.WithIdentity(context.Background(), md.Identity{Tenant: tenant, RunID: run})
	if timeout > 0 {
		c, cancel := context.WithTimeout(ctx, timeout)
		t.Cleanup(cancel)
		ctx = c
	}
	return ctx
}

// settle waits until the goroutine count is at most n, and returns it.
func settle(n int) int {
	g := runtime.NumGoroutine()
	for end := time.Now().Add(2 * time.Second); g > n && time.Now().Before(end); g = runtime.NumGoroutine() {
		time.Sleep(10 * time.Millisecond)
	}
	return g
}

func TestKeeperRenewsEveryLeaseInOneCallPerTickWithoutAGoroutineEach(t *testing.T) {
	p := &proxy{}
	c := serve(t, p)
	const period, n = 100 * time.Millisecond, 50
	k := decoderlease.New(c, decoderlease.Options{Period: period})
	if o := k.Options(); o.TTL != 3*period || o.MinTick != decoderlease.DefaultMinTick {
		t.Fatalf("options = %+v, want TTL 3 × period and the default tick", o)
	}
	// The connection's transport goroutines exist before the count is taken.
	if _, err := c.RenewLeases(context.Background(), &modelproxyv1.RenewLeasesRequest{}); err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	p.calls = nil
	p.mu.Unlock()
	time.Sleep(20 * time.Millisecond)
	base := runtime.NumGoroutine()
	leases := make([]*decoderlease.Lease, n)
	t.Cleanup(func() {
		for _, l := range leases {
			l.Release()
		}
	})
	want := make([]string, n)
	start := time.Now()
	for i := range leases {
		run := fmt.Sprintf("r-%02d", i)
		leases[i] = k.Hold(callCtx(t, "acme", run, 0), decoderlease.Key{RunID: run, NodeID: "root/m0", RetryID: "rid-" + run})
		want[i] = run + "/root/m0/rid-" + run
	}
	// 50 decoders held: one renewal goroutine (and a transient one of gRPC's per call
	// on the server side, in this process too), not 50.
	if g := runtime.NumGoroutine(); g > base+3 {
		t.Fatalf("goroutines: %d with %d leases held, %d before: the keeper must not start one per lease", g, n, base)
	}
	time.Sleep(5*period + period/2)
	if g := runtime.NumGoroutine(); g > base+3 {
		t.Fatalf("goroutines: %d while renewing %d leases, %d before", g, n, base)
	}
	for _, l := range leases {
		l.Release()
	}
	calls := p.renewals()
	if len(calls) < 4 || len(calls) > 7 {
		t.Fatalf("%d calls in %v, want one per %v tick (5)", len(calls), time.Since(start), period)
	}
	for i, r := range calls {
		got := slices.Sorted(slices.Values(r.keys))
		if !slices.Equal(got, want) || r.tenant != "acme" || r.ttl != 3*period {
			t.Fatalf("call %d: tenant %q, ttl %v, %d keys, want acme, %v and all %d keys in one call", i, r.tenant, r.ttl, len(r.keys), 3*period, n)
		}
		if i > 0 {
			// One period apart, give or take scheduling on a loaded machine.
			if gap := r.at.Sub(calls[i-1].at); gap > period+period/2 || gap < period/2 {
				t.Fatalf("calls %d and %d are %v apart, want the period %v", i-1, i, gap, period)
			}
		}
	}
	if s := k.Stats(); s.Calls != uint64(len(calls)) || s.Renewed != uint64(n*len(calls)) || s.Failed != 0 || s.Held != 0 {
		t.Fatalf("stats = %+v after %d calls", s, len(calls))
	}
	// Every lease released: the renewal goroutine ends and no call follows.
	if g := settle(base); g > base {
		t.Fatalf("goroutines: %d after every lease was released, %d before", g, base)
	}
	time.Sleep(2 * period)
	if got := len(p.renewals()); got != len(calls) {
		t.Fatalf("%d calls after every lease was released", got-len(calls))
	}
}

func TestKeeperRenewsAtLeastEveryThirdOfTheRemainingDeadline(t *testing.T) {
	p := &proxy{}
	c := serve(t, p)
	k := decoderlease.New(c, decoderlease.Options{Period: 10 * time.Second})
	const timeout = 900 * time.Millisecond
	ctx := callCtx(t, "", "r-dl", timeout)
	dl, _ := ctx.Deadline()
	start := time.Now()
	short := k.Hold(ctx, decoderlease.Key{RunID: "r-dl", NodeID: "root/m0", RetryID: "rid-dl"})
	defer short.Release()
	// Without a deadline, the configured 10 s period: it is never due in this test, and
	// it does not ride along before it has used half its period.
	long := k.Hold(callCtx(t, "", "r-nodl", 0), decoderlease.Key{RunID: "r-nodl", NodeID: "root/m0", RetryID: "rid-nodl"})
	defer long.Release()
	time.Sleep(timeout - 50*time.Millisecond)
	calls := p.renewals()
	if len(calls) < 4 {
		t.Fatalf("%d renewals of a lease with %v left, want at least 4 as the deadline nears", len(calls), timeout)
	}
	prev := start
	for i, r := range calls {
		if !slices.Equal(r.keys, []string{"r-dl/root/m0/rid-dl"}) || r.tenant != md.DefaultTenant {
			t.Fatalf("call %d: tenant %q keys %v, want the deadline-bound lease alone, default tenant", i, r.tenant, r.keys)
		}
		// remaining/3 at the previous renewal, floored at the minimum tick, plus
		// scheduling slack.
		bound := max(dl.Sub(prev)/3, decoderlease.DefaultMinTick) + 50*time.Millisecond
		if gap := r.at.Sub(prev); gap > bound {
			t.Fatalf("renewal %d came %v after the previous one, when %v was left: more than a third of it", i, gap, dl.Sub(prev))
		}
		prev = r.at
	}
}

func TestKeeperReleaseAndTenants(t *testing.T) {
	p := &proxy{unknown: map[string]bool{"r-gone": true}}
	c := serve(t, p)
	const period = 60 * time.Millisecond
	k := decoderlease.New(c, decoderlease.Options{Period: period, TTL: time.Second})
	a := k.Hold(callCtx(t, "acme", "r-a", 0), decoderlease.Key{RunID: "r-a", NodeID: "root/m0", RetryID: "x"})
	b := k.Hold(callCtx(t, "globex", "r-b", 0), decoderlease.Key{RunID: "r-b", NodeID: "root/m0", RetryID: "y"})
	gone := k.Hold(callCtx(t, "acme", "r-gone", 0), decoderlease.Key{RunID: "r-gone", NodeID: "root/m0", RetryID: "z"})
	time.Sleep(3*period + period/2)
	a.Release()
	a.Release() // twice is harmless
	released := time.Now()
	time.Sleep(3 * period)
	b.Release()
	gone.Release()
	var nil1 *decoderlease.Lease
	nil1.Release()

	byTenant := map[string]int{}
	for _, r := range p.renewals() {
		byTenant[r.tenant]++
		if r.ttl != time.Second {
			t.Fatalf("renewal ttl = %v, want the configured 1s", r.ttl)
		}
		for _, key := range r.keys {
			switch {
			case r.tenant == "acme" && (key == "r-a/root/m0/x" || key == "r-gone/root/m0/z"):
				if key == "r-a/root/m0/x" && r.at.After(released.Add(10*time.Millisecond)) {
					t.Fatalf("released lease %s renewed %v after its release", key, r.at.Sub(released))
				}
			case r.tenant == "globex" && key == "r-b/root/m0/y":
			default:
				t.Fatalf("tenant %s renewed %s: a call carries only its own tenant's keys", r.tenant, key)
			}
		}
	}
	if byTenant["acme"] < 4 || byTenant["globex"] < 4 {
		t.Fatalf("calls by tenant = %v, want one per tick for each", byTenant)
	}
	// The server's "unknown" is counted; the key is kept (a renewal can reach the server
	// before the decoder registers its lease).
	if s := k.Stats(); s.Unknown < 4 || s.Held != 0 {
		t.Fatalf("stats = %+v, want the unknown key counted on every call", s)
	}
}

func TestKeeperFailuresAreCountedAndKeepGoing(t *testing.T) {
	cc := meshtest.Serve(t, mesh.ServerConfig{}, nil) // no ModelProxyService: UNIMPLEMENTED
	var logs strings.Builder
	log := slog.New(slog.NewTextHandler(&logs, nil))
	k := decoderlease.New(modelproxyv1.NewModelProxyServiceClient(cc), decoderlease.Options{Period: 50 * time.Millisecond, Log: log})
	l := k.Hold(callCtx(t, "", "r", 0), decoderlease.Key{RunID: "r", NodeID: "root/m0", RetryID: "x"})
	time.Sleep(180 * time.Millisecond)
	l.Release()
	if s := k.Stats(); s.Calls < 2 || s.Failed != s.Calls {
		t.Fatalf("stats = %+v, want every call failed and renewals continuing", s)
	}
	if n := strings.Count(logs.String(), "decoder lease renewal failed"); n != 1 {
		t.Fatalf("logged %d failures, want one per streak:\n%s", n, logs.String())
	}
}

func TestSharedKeeperPerClientAndOptions(t *testing.T) {
	c1 := modelproxyv1.NewModelProxyServiceClient(meshtest.Serve(t, mesh.ServerConfig{}, nil))
	c2 := modelproxyv1.NewModelProxyServiceClient(meshtest.Serve(t, mesh.ServerConfig{}, nil))
	k := decoderlease.Shared(c1, decoderlease.Options{})
	if k == nil || decoderlease.Shared(c1, decoderlease.Options{}) != k {
		t.Fatal("Shared returned different keepers for one client")
	}
	if decoderlease.Shared(c1, decoderlease.Options{Period: decoderlease.DefaultPeriod, TTL: 3 * decoderlease.DefaultPeriod}) != k {
		t.Fatal("options equal once defaulted gave another keeper")
	}
	if decoderlease.Shared(c2, decoderlease.Options{}) == k || decoderlease.Shared(c1, decoderlease.Options{Period: time.Second}) == k {
		t.Fatal("another client or other options shared a keeper")
	}
	if decoderlease.Shared(nil, decoderlease.Options{}) != nil {
		t.Fatal("Shared(nil) is not nil")
	}
	var none *decoderlease.Keeper
	if l := none.Hold(context.Background(), decoderlease.Key{}); l != nil || none.TTLProto() != nil {
		t.Fatal("a nil keeper holds leases")
	}
	if k.TTLProto().AsDuration() != 3*decoderlease.DefaultPeriod {
		t.Fatalf("TTLProto = %v, want 12s", k.TTLProto().AsDuration())
	}
}

func TestKeeperHoldEveryBypassesTheThirdOfTheRemainingDeadline(t *testing.T) {
	p := &proxy{}
	c := serve(t, p)
	k := decoderlease.New(c, decoderlease.Options{Period: 100 * time.Millisecond})
	ctx := callCtx(t, "", "r-slow", 900*time.Millisecond)
	start := time.Now()
	l := k.HoldEvery(ctx, decoderlease.Key{RunID: "r-slow", NodeID: "root/m0", RetryID: "rid-slow"}, 400*time.Millisecond)
	defer l.Release()
	time.Sleep(700 * time.Millisecond)
	calls := p.renewals()
	// Hold would renew every 100 ms (and faster as the deadline nears); HoldEvery's fixed
	// 400 ms gives one renewal, at about 400 ms.
	if len(calls) != 1 {
		t.Fatalf("%d renewals in 700 ms, want 1 (every 400 ms, whatever the period or deadline)", len(calls))
	}
	if gap := calls[0].at.Sub(start); gap < 350*time.Millisecond || gap > 550*time.Millisecond {
		t.Fatalf("renewal came after %v, want about 400 ms", gap)
	}
}
