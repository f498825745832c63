package retry_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"google.golang.org/grpc/metadata"

	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

func TestNewIDIsUUIDv7(t *testing.T) {
	a, err := retry.NewID()
	if err != nil {
		t.Fatal(err)
	}
	b, _ := retry.NewID()
	if u, err := uuid.Parse(a); err != nil || u.Version() != 7 {
		t.Errorf("retry-id %q is not a UUIDv7 (%v)", a, err)
	}
	if a == b {
		t.Errorf("two retry-ids are both %q", a)
	}
}

func TestWithID(t *testing.T) {
	// None on the context: one is minted and added, once.
	ctx, id, err := retry.WithID(context.Background())
	if err != nil || id == "" {
		t.Fatalf("WithID = %q, %v", id, err)
	}
	if got := metadata.ValueFromOutgoingContext(ctx, md.RetryID); len(got) != 1 || got[0] != id {
		t.Errorf("outgoing retry-id %q, want [%q]", got, id)
	}
	// One on the context (the caller's, or minted before): kept, nothing added.
	again, id2, err := retry.WithID(ctx)
	if err != nil || id2 != id || again != ctx {
		t.Errorf("WithID on a context with retry-id %q = %q, %v (same ctx %v), want it kept", id, id2, err, again == ctx)
	}
	// An empty value counts as none.
	empty := metadata.AppendToOutgoingContext(context.Background(), md.RetryID, "")
	if _, id3, _ := retry.WithID(empty); id3 == "" {
		t.Error("WithID kept an empty retry-id")
	}
}
