package clusterslots_test

import (
	"context"
	"fmt"
	"time"

	"github.com/curfew-mesh/curfew/mesh/clusterslots"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
)

// A process holds a pool's slots for its runs: size the scope from the configuration,
// acquire a slot per admitted run, watch for its loss while the run goes on, release it
// when the run ends.
func Example() {
	ctx := context.Background()
	st, err := memory.Open(ctx, "memory://example-clusterslots")
	if err != nil {
		panic(err)
	}
	defer func() { _ = st.Close() }()
	h, err := clusterslots.New(clusterslots.Config{Store: st, TTL: 10 * time.Second})
	if err != nil {
		panic(err)
	}
	defer func() { _ = h.Close(ctx) }()
	if err := h.Size(ctx, "pool/paid", 2); err != nil {
		panic(err)
	}
	wait, cancel := context.WithTimeout(ctx, time.Second) // the run's own deadline
	defer cancel()
	slot, err := h.Acquire(wait, "pool/paid")
	if err != nil {
		panic(err) // admission: shed, or the degraded mode when the store is down
	}
	// While the run goes on, its supervisor selects on slot.Lost() beside the run's
	// end: on a loss, count it and let the run finish (docs/cluster.md).
	select {
	case <-slot.Lost():
		fmt.Println("lost:", slot.Err())
	default:
	}
	fmt.Println("held slot", slot.Info().N, "epoch", slot.Info().Epoch)
	_ = slot.Release(ctx)
	// Output: held slot 0 epoch 1
}
