package storetest

import (
	"context"
	"fmt"
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

// The run list benchmark's store: BenchRuns runs of BenchTenants tenants, created
// benchRunEvery apart by the store's clock (four hours in all) from [NewClock]'s
// instant, round-robin over nine common models and, every 200th run, the rare one.
const (
	BenchRuns     = 10_000
	BenchTenants  = 20
	BenchRareRuns = BenchRuns / 200
	benchRunEvery = 1440 * time.Millisecond
	benchRare     = "rare-model"
)

// SeedBenchRuns creates the run list benchmark's BenchRuns runs in s, whose clock must
// be clock (store.WithClock(clock.Now)): BenchTenants tenants, nine common models
// round-robin and one rare model (every 200th run), created 1.44 s apart, half left
// running and the others succeeded, failed or cancelled.
func SeedBenchRuns(ctx context.Context, s store.Store, clock *Clock) error {
	ended := []store.RunStatus{store.StatusSucceeded, store.StatusFailed, store.StatusCancelled}
	for i := range BenchRuns {
		model := "model-" + strconv.Itoa(i%9)
		if i%200 == 100 {
			model = benchRare
		}
		r, _, err := s.CreateRun(ctx, store.NewRun{Tenant: fmt.Sprintf("tenant-%02d", (i+i/200)%BenchTenants), Model: model,
			Task: []byte(`{"steps":[{"answer_tokens":5}]}`), Deadline: clock.Now().Add(time.Minute), Owner: "bench", LeaseTTL: time.Hour})
		if err != nil {
			return err
		}
		if i%2 == 0 {
			if _, err := s.FinishRun(ctx, r.Lease(), store.RunResult{Status: ended[i/2%3], Answer: []byte("42")}); err != nil {
				return err
			}
		}
		clock.Advance(benchRunEvery)
	}
	return nil
}

// BenchRareQuery is the operator's query the run list benchmark measures: every
// tenant's runs of the rare model created in the third hour of the store, the first
// page of 50 (a console page).
func BenchRareQuery() store.RunQuery {
	t0 := NewClock().Now()
	return store.RunQuery{AllTenants: true, Model: benchRare,
		CreatedAfter: t0.Add(2 * time.Hour), CreatedBefore: t0.Add(3 * time.Hour), Limit: 50}
}

// BenchmarkRunList measures ListRuns with the console's filters on the store at dsn
// with BenchRuns runs: the rare model in one hour across tenants (BenchRareQuery, the
// issue's target), and for comparison a common model in the same hour, every
// tenant's first page, one tenant's ended runs in the hour, and the running runs (all,
// and in the hour). Each
// is a sub-benchmark reporting the median and the 99th percentile of the calls. After
// seeding it calls inspect, when not nil, with BenchRareQuery, so that a backend can log
// its plan. Half the runs are left running; the others end succeeded, failed or
// cancelled.
func BenchmarkRunList(b *testing.B, dsn string, inspect func(b *testing.B, q store.RunQuery), opts ...store.Option) {
	ctx := context.Background()
	clock := NewClock()
	s, err := store.Open(ctx, dsn, append(opts, store.WithClock(clock.Now))...)
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	start := time.Now()
	if err := SeedBenchRuns(ctx, s, clock); err != nil {
		b.Fatal(err)
	}
	b.Logf("seeded %d runs in %v", BenchRuns, time.Since(start).Round(time.Millisecond))
	rare := BenchRareQuery()
	if inspect != nil {
		inspect(b, rare)
	}
	hour := func(q store.RunQuery) store.RunQuery {
		q.CreatedAfter, q.CreatedBefore = rare.CreatedAfter, rare.CreatedBefore
		return q
	}
	for _, c := range []struct {
		name string
		q    store.RunQuery
		want int // runs on the page
	}{
		{"rare-model-1h", rare, 12},
		{"common-model-1h", hour(store.RunQuery{AllTenants: true, Model: "model-3", Limit: 50}), 50},
		{"all-tenants", store.RunQuery{AllTenants: true, Limit: 50}, 50},
		{"tenant-succeeded-1h", hour(store.RunQuery{Tenant: "tenant-07", Status: store.StatusSucceeded, Limit: 50}), 22},
		{"running", store.RunQuery{AllTenants: true, Status: store.StatusRunning, Limit: 50}, 50},
		{"running-1h", hour(store.RunQuery{AllTenants: true, Status: store.StatusRunning, Limit: 50}), 50},
	} {
		b.Run(c.name, func(b *testing.B) {
			var lat []time.Duration
			for b.Loop() {
				t := time.Now()
				runs, _, err := s.ListRuns(ctx, c.q)
				lat = append(lat, time.Since(t))
				if err != nil || len(runs) != c.want {
					b.Fatalf("list %+v: %d runs, %v; want %d", c.q, len(runs), err, c.want)
				}
			}
			b.StopTimer()
			slices.Sort(lat)
			at := func(q float64) float64 { return float64(lat[int(q*float64(len(lat)-1))].Microseconds()) }
			b.ReportMetric(at(0.50), "p50-us")
			b.ReportMetric(at(0.99), "p99-us")
		})
	}
}
