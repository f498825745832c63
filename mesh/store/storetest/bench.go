package storetest

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// BenchmarkCheckpoint measures one agent step's checkpoint on the store at dsn: a
// PutCheckpoint of a step's assistant message with two tool calls (≈ 250 bytes) and
// their results, fenced by the run's lease, committed. Backends call it from their own
// Benchmark functions. Besides ns/op (the mean) it reports the median and the 99th
// percentile of the individual calls.
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
	var lat []time.Duration
	for b.Loop() {
		start := time.Now()
		if err := s.PutCheckpoint(ctx, l, store.Checkpoint{Step: step, ModelOutput: model, ToolResults: tools, Tokens: 120}); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		step++
	}
	b.StopTimer()
	slices.Sort(lat)
	at := func(q float64) float64 { return float64(lat[int(q*float64(len(lat)-1))].Microseconds()) }
	b.ReportMetric(at(0.50), "p50-us")
	b.ReportMetric(at(0.99), "p99-us")
}
