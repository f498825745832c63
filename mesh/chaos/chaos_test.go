package chaos

import (
	"context"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/md"
)

func TestParse(t *testing.T) {
	s, err := Parse(" orphan, drop-cancel,slow-heartbeat=5s,no-retry-id,worker-ledger,no-dedupe")
	if err != nil {
		t.Fatal(err)
	}
	want := Settings{Orphan: true, DropCancel: true, SlowHeartbeat: 5 * time.Second, NoRetryID: true, WorkerLedger: true, NoDedupe: true}
	if s != want {
		t.Fatalf("got %+v, want %+v", s, want)
	}
	back, err := Parse(s.String())
	if err != nil || back != s {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
	for _, bad := range []string{"nope", "orphan=1", "slow-heartbeat=x", "slow-heartbeat=-1s", "slow-heartbeat"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q): no error", bad)
		}
	}
	if s, err := Parse(""); err != nil || s.Any() {
		t.Fatalf("empty: %+v, %v", s, err)
	}
}

func TestFrom(t *testing.T) {
	ctx := md.WithIdentity(context.Background(), md.Identity{Chaos: "drop-cancel"})
	if !From(ctx).DropCancel {
		t.Fatal("From: drop-cancel not seen")
	}
	if From(md.WithIdentity(context.Background(), md.Identity{Chaos: "bogus"})).Any() {
		t.Fatal("an unparsable value must count as no chaos")
	}
}
