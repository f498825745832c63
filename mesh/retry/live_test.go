package retry_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/retry"
)

// A reload stores a new File in Live: a connection made before takes the new policy
// from its next call on (seed 003: restoring the previous retry limit is a reload).
func TestLivePolicyChangesOnReload(t *testing.T) {
	svc := &nodes{fail: func(context.Context, int) error { return status.Error(codes.Unavailable, "down") }}
	first, err := retry.DecodeFile([]byte(`{"default": {"max_attempts": 2}, "targets": {"nodes": {"methods": {"` + listNodes + `": {"max_attempts": 4}}}}}`))
	if err != nil {
		t.Fatal(err)
	}
	live := retry.NewLive(first)
	cfg := live.For("nodes")
	cfg.Sleep = (&sleeper{}).Sleep
	cc := dial(t, serve(t, svc, nil), cfg)
	if err := listNodesCall(callCtx(t), cc); !retry.IsExhausted(err) {
		t.Fatalf("ListNodes: %v, want exhausted", err)
	}
	if n := len(svc.all()); n != 4 {
		t.Fatalf("%d attempts under the first file, want 4", n)
	}

	second, err := retry.DecodeFile([]byte(`{"default": {"max_attempts": 1}}`))
	if err != nil {
		t.Fatal(err)
	}
	live.Store(second)
	if err := listNodesCall(callCtx(t), cc); status.Code(err) != codes.Unavailable {
		t.Fatalf("ListNodes: %v, want UNAVAILABLE", err)
	}
	if n := len(svc.all()); n != 5 {
		t.Fatalf("%d attempts after the reload, want one more", n-4)
	}
}

func TestFlagsDecodeKeepsExplicitFlags(t *testing.T) {
	f := retry.Flags{File: "retry.json", MaxAttempts: 2}
	got, err := f.Decode([]byte(`{"default": {"max_attempts": 5}}`), map[string]bool{"retry-max-attempts": true})
	if err != nil {
		t.Fatal(err)
	}
	if p := got.For("x").Default; p.MaxAttempts != 2 {
		t.Fatalf("max attempts %d, want the explicit flag's 2", p.MaxAttempts)
	}
	if _, err := f.Decode([]byte(`{"default": {"max_attempts": 9}}`), nil); err == nil {
		t.Fatal("a file with 9 attempts decoded")
	}
	if _, err := f.Decode([]byte(`{"bogus": 1}`), nil); err == nil {
		t.Fatal("a file with an unknown field decoded")
	}
}
