package retry_test

import (
	"context"
	"errors"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// A backup (retry.Hedge) is sent once, marked curfew-hedge: 1, with the twin's retry-id
// the caller gives; it is never retried, and it spends the budget's retry allowance: when
// the budget would refuse a retry, the backup is refused before anything is sent.
func TestHedgeMarkedOnceAndBudgeted(t *testing.T) {
	svc := &nodes{fail: func(context.Context, int) error { return status.Error(codes.Unavailable, "down") }}
	clk := newClock()
	// Retries may add 100 % of requests, no floor: one call buys one retry or one backup.
	cfg := retry.Config{Target: "nodes", Budget: retry.BudgetConfig{Ratio: 1}, Now: clk.Now, Sleep: (&sleeper{}).Sleep}
	cc := dial(t, serve(t, svc, nil), cfg)

	ctx := metadata.AppendToOutgoingContext(callCtx(t), md.RetryID, "twin-1")
	if err := listNodesCall(ctx, cc, retry.Hedge()); status.Code(err) != codes.ResourceExhausted || !errors.Is(err, retry.ErrHedgeRefused) {
		t.Fatalf("backup with no request in the window: %v, want refused by the budget", err)
	}
	if n := len(svc.all()); n != 0 {
		t.Fatalf("a refused backup reached the server (%d calls)", n)
	}

	svc.fail = nil
	if err := listNodesCall(callCtx(t), cc); err != nil { // the twin: one request
		t.Fatalf("twin: %v", err)
	}
	svc.fail = func(context.Context, int) error { return status.Error(codes.Unavailable, "down") }
	err := listNodesCall(ctx, cc, retry.Hedge())
	if status.Code(err) != codes.Unavailable || retry.IsExhausted(err) {
		t.Fatalf("backup: %v, want its own UNAVAILABLE, unretried and unmarked", err)
	}
	got := svc.all()
	if len(got) != 2 {
		t.Fatalf("server saw %d calls, want the twin and one backup attempt", len(got))
	}
	b := got[1]
	if len(b.hedges) != 1 || b.hedges[0] != md.HedgeBackup {
		t.Errorf("backup's curfew-hedge %q, want [%q]", b.hedges, md.HedgeBackup)
	}
	if len(b.retryIDs) != 1 || b.retryID() != "twin-1" || b.attempt() != "1" {
		t.Errorf("backup's retry-id %q attempt %q, want the twin's id once, attempt 1", b.retryIDs, b.attempts)
	}
	if len(got[0].hedges) != 0 {
		t.Errorf("the twin carries curfew-hedge %q", got[0].hedges)
	}
	// The one backup spent the one allowance: a second is refused.
	if err := listNodesCall(ctx, cc, retry.Hedge()); !errors.Is(err, retry.ErrHedgeRefused) {
		t.Fatalf("second backup: %v, want refused", err)
	}
}
