package modelproxy

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
)

// ListDecoders reports the replica's coordinated limits: the token budgets held in the
// store and each provider breaker's probe lease, coordinated while the store answers
// and degraded, with since when, once it does not.
func TestListDecodersReportsCoordination(t *testing.T) {
	pe := newProviderEnv(t, oneProvider, "p")
	ctx := t.Context()
	shared, err := memory.Open(ctx, "memory://"+t.Name()+"-shared")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = shared.Close() })
	b, err := budget.NewShared(budget.SharedConfig{Store: shared, Logger: slog.New(slog.DiscardHandler),
		Limits:   admission.Config{Tenants: map[string]admission.TenantLimits{"acme": {TokenBudget: 1000}}},
		Replicas: func(context.Context) (int, error) { return 2, nil }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	pe.srv.Budgets = b
	if err := pe.srv.Router.Breakers().Coordinate(ctx, breaker.Coordination{Store: shared}); err != nil {
		t.Fatal(err)
	}
	if h, err := b.Reserve(ctx, "acme", 10); err != nil {
		t.Fatal(err)
	} else {
		h.Settle(5)
	}

	list := func() []*modelproxyv1.Coordination {
		t.Helper()
		ls, err := pe.model.ListDecoders(ctx, &modelproxyv1.ListDecodersRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return ls.GetCoordination()
	}
	check := func(c *modelproxyv1.Coordination, part, target string, degraded bool, detail string) {
		t.Helper()
		if c.GetService() != "modelproxy" || c.GetReplica() != pe.srv.Replica || c.GetPart() != part || c.GetTarget() != target ||
			c.GetDegraded() != degraded || !strings.Contains(c.GetDetail(), detail) || (c.GetSince() != nil) != degraded {
			t.Errorf("coordination %v, want %s %q degraded %v (since set when degraded), detail with %q", c, part, target, degraded, detail)
		}
	}
	co := list()
	if len(co) != 2 {
		t.Fatalf("coordination %v, want the budgets and provider p's probe lease", co)
	}
	check(co[0], "budget", "", false, "reservations in the store")
	check(co[1], "breaker_probe", "p", false, "one probe per open period")

	_ = shared.Close() // every store call fails from now on
	if h, err := b.Reserve(ctx, "acme", 10); err != nil {
		t.Fatalf("a reservation within the share with the store down: %v", err)
	} else {
		h.Settle(5)
	}
	p := pe.srv.Router.Breaker("p")
	for i := 0; p.State() == breaker.StateClosed; i++ {
		if i == 50 {
			t.Fatal("provider p's breaker did not open after 50 failures")
		}
		done, err := p.Allow(ctx)
		if err != nil {
			t.Fatal(err)
		}
		done(status.Error(codes.Unavailable, "down"))
	}
	for deadline := time.Now().Add(5 * time.Second); !p.CoordinationDegraded(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the open breaker did not find the store down within 5 s")
		}
	}
	co = list()
	if len(co) != 2 {
		t.Fatalf("coordination %v, want the budgets and provider p's probe lease", co)
	}
	check(co[0], "budget", "", true, "store unreachable: reserving against this replica's share, (budget - used) / 2 replicas; 1 settlements")
	check(co[1], "breaker_probe", "p", true, "store unreachable: probes on its own")
	if since := co[0].GetSince().AsTime(); time.Since(since) > time.Minute || since.After(time.Now()) {
		t.Errorf("the budgets degraded since %v, want just now", since)
	}
}
