package modelproxy

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/decoderlease"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// longPlan decodes for 100 s at 100 tokens/s: it ends only when something stops it.
const longPlan = `{"tokens_per_second":100,"steps":[{"think_tokens":10000,"tools":[{"name":"sleep","args":{"ms":1}}]},{"answer_tokens":1}]}`

// leaseCtx is a call context of tenant, run and node with the retry-id rid on the wire.
func leaseCtx(tenant, run, node, rid string) context.Context {
	ctx := md.WithIdentity(context.Background(), md.Identity{Tenant: tenant, RunID: run, NodeID: node})
	return metadata.AppendToOutgoingContext(ctx, md.RetryID, rid)
}

func key(run, node, rid string) *modelproxyv1.LeaseKey {
	return &modelproxyv1.LeaseKey{RunId: run, NodeId: node, RetryId: rid}
}

// leaseEnv is newEnv with the lapse warnings discarded.
func leaseEnv(t *testing.T) *env {
	e := newEnv(t, mesh.ServerConfig{})
	e.srv.Log = slog.New(slog.DiscardHandler)
	return e
}

// waitLeases waits until the server holds n leases.
func waitLeases(t *testing.T, s *Server, n int) {
	t.Helper()
	for end := time.Now().Add(3 * time.Second); s.Leases.Len() != n; {
		if time.Now().After(end) {
			t.Fatalf("the server holds %d leases, want %d", s.Leases.Len(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestLeaseLapseStopsUnrenewedDecoder(t *testing.T) {
	e := leaseEnv(t)
	const run, node, ttl = "r-lapse", "root/m0", 300 * time.Millisecond
	start := time.Now()
	st, err := e.model.Generate(leaseCtx("acme", run, node, "rid-lapse"), &modelproxyv1.GenerateRequest{
		Messages: conversation(longPlan, 0), LeaseTtl: durationpb.New(ttl)})
	if err != nil {
		t.Fatal(err)
	}
	// The caller reads every token but never renews: the cancel it would send is what a
	// lost RST_STREAM looks like from the decoder's side.
	chunks, err := meshtest.Drain(st)
	elapsed := time.Since(start)
	meshtest.WantCode(t, err, codes.Canceled, "decoder lease expired")
	if elapsed < ttl || elapsed > ttl+time.Second {
		t.Fatalf("the decoder stopped after %v, want its lease TTL %v (plus a margin)", elapsed, ttl)
	}
	if len(chunks) == 0 || len(chunks) > 60 {
		t.Fatalf("got %d tokens, want the ~30 of the TTL at 100/s", len(chunks))
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED {
		t.Fatalf("node = %v, want CANCELLED with cause LEASE_EXPIRED", n)
	}
	if n.GetCancelledAt() == nil || n.GetCancelledAt().AsTime().Sub(start) < ttl {
		t.Fatalf("node cancelled_at = %v, want at the lapse, %v after the start", n.GetCancelledAt(), ttl)
	}
	if e.srv.Leases.Len() != 0 {
		t.Fatalf("%d leases left after the decoder stopped", e.srv.Leases.Len())
	}
}

func TestLeaseRenewedDecoderRunsPastTTL(t *testing.T) {
	e := leaseEnv(t)
	const ttl = 200 * time.Millisecond
	// 90 tokens at 60/s: 1.5 s, more than 7 TTLs.
	p := `{"tokens_per_second":60,"steps":[{"answer_tokens":90}]}`
	for _, by := range []string{"keeper", "hand"} {
		t.Run(by, func(t *testing.T) {
			run, node, rid := "r-renew-"+by, "root/m0", "rid-"+by
			ctx := leaseCtx("acme", run, node, rid)
			done := make(chan struct{})
			var wg sync.WaitGroup
			if by == "keeper" {
				k := decoderlease.New(e.model, decoderlease.Options{Period: 60 * time.Millisecond, TTL: ttl})
				l := k.Hold(ctx, decoderlease.Key{RunID: run, NodeID: node, RetryID: rid})
				defer func() {
					l.Release()
					if s := k.Stats(); s.Calls < 5 || s.Failed != 0 {
						t.Errorf("keeper stats = %+v, want renewals every 60ms and none failed", s)
					}
				}()
			} else {
				wg.Add(1)
				go func() { // the caller's heartbeat, every 60 ms
					defer wg.Done()
					tick := time.NewTicker(60 * time.Millisecond)
					defer tick.Stop()
					for {
						select {
						case <-done:
							return
						case <-tick.C:
						}
						rctx := md.WithIdentity(context.Background(), md.Identity{Tenant: "acme"})
						if _, err := e.model.RenewLeases(rctx, &modelproxyv1.RenewLeasesRequest{Keys: []*modelproxyv1.LeaseKey{key(run, node, rid)},
							Ttl: durationpb.New(ttl)}); err != nil {
							t.Errorf("RenewLeases: %v", err)
						}
					}
				}()
			}
			start := time.Now()
			chunks, err := generate(ctx, t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(p, 0), LeaseTtl: durationpb.New(ttl)})
			close(done)
			wg.Wait()
			if err != nil {
				t.Fatalf("renewed decoder: %v", err)
			}
			if elapsed := time.Since(start); elapsed < 5*ttl {
				t.Fatalf("decode took %v, want well past the TTL %v", elapsed, ttl)
			}
			if len(chunks) != 91 || chunks[90].GetFinishReason() != "stop" {
				t.Fatalf("got %d chunks, want all 90 tokens and the final chunk", len(chunks))
			}
			if n := meshtest.WaitNode(t, e.srv.Nodes, run, node); n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
				t.Fatalf("node = %v, want SUCCEEDED", n)
			}
		})
	}
}

func TestRenewLeasesUnknownKeys(t *testing.T) {
	e := leaseEnv(t)
	const run, node, rid = "r-unknown", "root/m0", "rid-live"
	ctx, stop := context.WithCancel(leaseCtx("", run, node, rid))
	defer stop()
	st, err := e.model.Generate(ctx, &modelproxyv1.GenerateRequest{Messages: conversation(longPlan, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	live := key(run, node, rid)
	others := []*modelproxyv1.LeaseKey{
		key(run, node, "rid-other"),      // another retry-id
		key(run, "root/m1", rid),         // another node
		key("r-never", node, rid),        // another run
		key("", "", ""),                  // a call that named nothing
		key(run, node+"/sub", "rid-sub"), // beneath the node
	}
	renew := func(keys ...*modelproxyv1.LeaseKey) []*modelproxyv1.LeaseKey {
		t.Helper()
		// No tenant on the call: the default tenant, as on Generate.
		resp, err := e.model.RenewLeases(context.Background(), &modelproxyv1.RenewLeasesRequest{Keys: keys})
		if err != nil {
			t.Fatal(err)
		}
		return resp.GetUnknown()
	}
	unknown := renew(append([]*modelproxyv1.LeaseKey{live}, others...)...)
	if len(unknown) != len(others) {
		t.Fatalf("unknown = %v, want every key but the live decoder's", unknown)
	}
	for i, k := range unknown {
		if k.GetRunId() != others[i].GetRunId() || k.GetNodeId() != others[i].GetNodeId() || k.GetRetryId() != others[i].GetRetryId() {
			t.Fatalf("unknown[%d] = %v, want %v", i, k, others[i])
		}
	}
	if u := renew(); len(u) != 0 {
		t.Fatalf("an empty renewal returned %v", u)
	}
	stop()
	_, _ = meshtest.Drain(st)
	meshtest.WaitNode(t, e.srv.Nodes, run, node)
	waitLeases(t, e.srv, 0)
	if u := renew(live); len(u) != 1 {
		t.Fatalf("renewing an ended decoder's lease: unknown = %v, want it", u)
	}

	for _, tc := range []struct {
		ttl  *durationpb.Duration
		want string
	}{
		{durationpb.New(-time.Second), "ttl must be 0"},
		{durationpb.New(10 * time.Millisecond), "at least 50ms"},
		{&durationpb.Duration{Seconds: 1, Nanos: -5}, "ttl"},
	} {
		_, err := e.model.RenewLeases(context.Background(), &modelproxyv1.RenewLeasesRequest{Keys: []*modelproxyv1.LeaseKey{live}, Ttl: tc.ttl})
		meshtest.WantCode(t, err, codes.InvalidArgument, tc.want)
	}
}

func TestRenewLeasesOtherTenantCannotRenew(t *testing.T) {
	e := leaseEnv(t)
	const run, node, rid, ttl = "r-tenant", "root/m0", "rid-tenant", 300 * time.Millisecond
	st, err := e.model.Generate(leaseCtx("acme", run, node, rid), &modelproxyv1.GenerateRequest{
		Messages: conversation(longPlan, 0), LeaseTtl: durationpb.New(ttl)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	k := key(run, node, rid)
	renew := func(tenant string) []*modelproxyv1.LeaseKey {
		resp, err := e.model.RenewLeases(md.WithIdentity(context.Background(), md.Identity{Tenant: tenant}),
			&modelproxyv1.RenewLeasesRequest{Keys: []*modelproxyv1.LeaseKey{k}, Ttl: durationpb.New(ttl)})
		if err != nil {
			t.Errorf("RenewLeases as %s: %v", tenant, err)
		}
		return resp.GetUnknown()
	}
	if u := renew("acme"); len(u) != 0 {
		t.Fatalf("the owner's renewal: unknown = %v, want none", u)
	}
	// Another tenant heartbeats the same key well within the TTL: it is not its lease,
	// so the decoder still lapses a TTL after the owner's last renewal.
	renewedAt := time.Now()
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		_, err = meshtest.Drain(st)
	}()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
heartbeat:
	for {
		select {
		case <-stopped:
			break heartbeat
		case <-tick.C:
		}
		if u := renew("globex"); len(u) != 1 {
			t.Errorf("another tenant's renewal: unknown = %v, want the key", u)
		}
	}
	<-stopped
	meshtest.WantCode(t, err, codes.Canceled, "lease expired")
	if d := time.Since(renewedAt); d > ttl+time.Second {
		t.Fatalf("the decoder stopped %v after its owner's last renewal, want its TTL %v", d, ttl)
	}
	if n := meshtest.WaitNode(t, e.srv.Nodes, run, node); n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED {
		t.Fatalf("node = %v, want cause LEASE_EXPIRED", n)
	}
}

func TestGenerateLeaseTTLValidation(t *testing.T) {
	e := leaseEnv(t)
	for _, tc := range []struct {
		ttl  *durationpb.Duration
		want string
	}{
		{durationpb.New(-time.Second), "lease_ttl must not be negative"},
		{durationpb.New(time.Millisecond), "lease_ttl must be at least 50ms"},
		{&durationpb.Duration{Seconds: -1, Nanos: 5}, "lease_ttl"},
	} {
		_, err := generate(ident("r-ttl", "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(toolPlan, 1), LeaseTtl: tc.ttl})
		meshtest.WantCode(t, err, codes.InvalidArgument, tc.want)
	}
	if ns, _ := e.srv.Nodes.List(context.Background(), "r-ttl", nil, 0); len(ns) != 0 {
		t.Fatalf("refused requests left nodes: %v", ns)
	}
}

// The server's default TTL applies to a caller that names none, and 0 turns it off.
func TestLeaseDefaultTTL(t *testing.T) {
	e := leaseEnv(t)
	if e.srv.Leases.TTL != DefaultLeaseTTL {
		t.Fatalf("default TTL = %v, want %v", e.srv.Leases.TTL, DefaultLeaseTTL)
	}
	e.srv.Leases.TTL = 250 * time.Millisecond
	start := time.Now()
	_, err := generate(leaseCtx("", "r-default", "root/m0", "rid-d"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(longPlan, 0)})
	meshtest.WantCode(t, err, codes.Canceled, "lease expired")
	if d := time.Since(start); d > 250*time.Millisecond+time.Second {
		t.Fatalf("lapsed after %v, want the server's default TTL", d)
	}

	e.srv.Leases.TTL = 0 // no lease: the decoder runs until its caller stops it
	ctx, stop := context.WithTimeout(ident("r-off", "root/m0"), 700*time.Millisecond)
	defer stop()
	_, err = generate(ctx, t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(longPlan, 0)})
	meshtest.WantCode(t, err, codes.DeadlineExceeded)
}

func TestLeaseAgeMetric(t *testing.T) {
	e := leaseEnv(t)
	reg := prometheus.NewRegistry()
	reg.MustRegister(e.srv.Leases.Collector())
	age := func() float64 {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil || len(mfs) != 1 || mfs[0].GetName() != "curfew_lease_age_seconds" {
			t.Fatalf("gather: %v %v", mfs, err)
		}
		return mfs[0].GetMetric()[0].GetGauge().GetValue()
	}
	if n, err := testutil.GatherAndCount(reg, "curfew_lease_age_seconds"); err != nil || n != 1 {
		t.Fatalf("series = %d, %v, want 1", n, err)
	}
	if a := age(); a != 0 {
		t.Fatalf("age with no decoder = %v, want 0", a)
	}
	ctx, stop := context.WithCancel(leaseCtx("", "r-age", "root/m0", "rid-age"))
	defer stop()
	st, err := e.model.Generate(ctx, &modelproxyv1.GenerateRequest{Messages: conversation(longPlan, 0)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond)
	if a := age(); a < 0.2 || a > 2 {
		t.Fatalf("age of a decoder started 200ms ago and never renewed = %v", a)
	}
	if _, err := e.model.RenewLeases(context.Background(), &modelproxyv1.RenewLeasesRequest{Keys: []*modelproxyv1.LeaseKey{key("r-age", "root/m0", "rid-age")}}); err != nil {
		t.Fatal(err)
	}
	if a := age(); a >= 0.2 {
		t.Fatalf("age right after a renewal = %v, want below 0.2", a)
	}
	stop()
	_, _ = meshtest.Drain(st)
	waitLeases(t, e.srv, 0)
	if a := age(); a != 0 {
		t.Fatalf("age after the decoder ended = %v, want 0", a)
	}
}

// A newer attempt of the same retry-id takes the key over: the earlier attempt's end
// does not drop it, and the earlier lease, displaced, never lapses the newer decoder.
func TestLeaseDisplacedByNewerAttempt(t *testing.T) {
	var lapsed []leaseKey
	var mu sync.Mutex
	tbl := newLeases(time.Hour, func(l *lease) {
		mu.Lock()
		defer mu.Unlock()
		lapsed = append(lapsed, l.key)
	})
	k := leaseKey{"t", "r", "root/m0", "rid"}
	first := tbl.hold(k, 80*time.Millisecond)
	second := tbl.hold(k, time.Hour)
	time.Sleep(200 * time.Millisecond) // the first lease's expiry passes
	tbl.end(first)
	if tbl.Len() != 1 {
		t.Fatalf("leases = %d after the earlier attempt ended, want the newer one's", tbl.Len())
	}
	if u := tbl.renew("t", []*modelproxyv1.LeaseKey{key("r", "root/m0", "rid")}, 0); len(u) != 0 {
		t.Fatalf("renewing the newer attempt: unknown = %v", u)
	}
	tbl.end(second)
	tbl.end(second) // twice is harmless
	mu.Lock()
	defer mu.Unlock()
	if len(lapsed) != 0 || tbl.Len() != 0 {
		t.Fatalf("lapsed = %v, leases = %d, want none", lapsed, tbl.Len())
	}
	if err := ValidateLeaseTTL(0); err != nil {
		t.Fatal(err)
	}
	for _, d := range []time.Duration{-time.Second, time.Millisecond} {
		if err := ValidateLeaseTTL(d); err == nil {
			t.Fatalf("ValidateLeaseTTL(%v) = nil", d)
		}
	}
}

// A renewal with a shorter TTL than the lease had brings its lapse forward.
func TestLeaseShorterRenewalLapsesSooner(t *testing.T) {
	lapsed := make(chan leaseKey, 1)
	tbl := newLeases(time.Hour, func(l *lease) { lapsed <- l.key })
	k := leaseKey{"t", "r", "root/m0", "rid"}
	l := tbl.hold(k, time.Hour)
	defer tbl.end(l)
	start := time.Now()
	tbl.renew("t", []*modelproxyv1.LeaseKey{key("r", "root/m0", "rid")}, 100*time.Millisecond)
	select {
	case got := <-lapsed:
		if got != k || time.Since(start) < 100*time.Millisecond {
			t.Fatalf("lapsed %v after %v", got, time.Since(start))
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the lease renewed with a 100ms TTL did not lapse")
	}
}
