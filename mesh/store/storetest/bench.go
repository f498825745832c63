package storetest

import (
	"context"
	"slices"
	"strconv"
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

// BenchmarkTokenBudget measures one model call's budget cost on the store at dsn: a
// ReserveTokens and its SettleTokens (one round trip each on PostgreSQL), one tenant,
// one caller. It reports the median and the 99th percentile of each half.
func BenchmarkTokenBudget(b *testing.B, dsn string, opts ...store.Option) {
	ctx := context.Background()
	s, err := store.Open(ctx, dsn, opts...)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	var reserve, settle []time.Duration
	n := 0
	for b.Loop() {
		n++
		id := "bench/" + strconv.Itoa(n)
		start := time.Now()
		r, err := s.ReserveTokens(ctx, store.TokenReservation{Tenant: "bench", Holder: "bench", ID: id, Tokens: 300,
			Budget: 1 << 40, Window: time.Hour, TTL: 10 * time.Second})
		if err != nil || !r.Granted {
			b.Fatalf("reserve: %+v, %v", r, err)
		}
		mid := time.Now()
		if err := s.SettleTokens(ctx, store.TokenSettlement{Tenant: "bench", ID: id, Actual: 200, Window: time.Hour}); err != nil {
			b.Fatal(err)
		}
		reserve, settle = append(reserve, mid.Sub(start)), append(settle, time.Since(mid))
	}
	b.StopTimer()
	for _, m := range []struct {
		name string
		lat  []time.Duration
	}{{"reserve", reserve}, {"settle", settle}} {
		slices.Sort(m.lat)
		at := func(q float64) float64 { return float64(m.lat[int(q*float64(len(m.lat)-1))].Microseconds()) }
		b.ReportMetric(at(0.50), m.name+"-p50-us")
		b.ReportMetric(at(0.99), m.name+"-p99-us")
	}
}
