package storetest

import (
	"context"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// BenchmarkCheckpoint measures one agent step's checkpoint on the store at dsn: a
// PutCheckpoint of a step's assistant message with two tool calls (≈ 250 bytes) and
// their results, fenced by the run's lease, committed. Backends call it from their own
// Benchmark functions.
func BenchmarkCheckpoint(b *testing.B, dsn string, opts ...store.Option) {
	ctx := context.Background()
	s, err := store.Open(ctx, dsn, opts...)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	r, _, err := s.CreateRun(ctx, store.NewRun{
		Tenant: "bench", Deadline: time.Now().Add(time.Hour), Owner: "bench", LeaseTTL: time.Hour,
	})
	if err != nil {
		b.Fatal(err)
	}
	l := r.Lease()
	model, tools := checkpointBytes(0)
	b.SetBytes(int64(len(model) + len(tools)))
	b.ResetTimer()
	step := 0
	for b.Loop() {
		if err := s.PutCheckpoint(ctx, l, store.Checkpoint{Step: step, ModelOutput: model, ToolResults: tools, Tokens: 120}); err != nil {
			b.Fatal(err)
		}
		step++
	}
}
