package bench

import (
	"io"
	"log/slog"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// BenchmarkChainAsServed compares four setups of the same health call, interleaved in
// rounds so they see the same noise: bare grpc-go; curfew's chain as BenchmarkChainLatency
// measures it (no breaker, no metrics); the chain with the standard gRPC metrics and the
// deadline slack on both sides (metrics: what issue 7's "≤ 3 % with export off" is
// about, reported as metrics-over-chain-%); and the chain as the services run it, the
// metrics and the per-target breaker on the client (what mesh/service installs; tracing
// stays off, as it is unless OTEL_* is set). Run it with -benchtime=<rounds>x.
//
//	go test -run '^$' -bench '^BenchmarkChainAsServed$' -benchtime 100x -count 3 ./bench/
func BenchmarkChainAsServed(b *testing.B) {
	bare, chain, ctx := chainPairs(b)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	reg := prometheus.NewRegistry()
	full := newHealthPair(b,
		mesh.ServerOptions(mesh.ServerConfig{Logger: quiet, Metrics: mesh.NewServerMetrics(reg)}),
		mesh.DialOptions(mesh.ClientConfig{Retry: retry.Config{Target: "svc"}, Breakers: breaker.NewSet(breaker.Config{}, reg),
			Metrics: mesh.NewClientMetrics(reg)}))
	mreg := prometheus.NewRegistry()
	metrics := newHealthPair(b,
		mesh.ServerOptions(mesh.ServerConfig{Logger: quiet, Metrics: mesh.NewServerMetrics(mreg)}),
		mesh.DialOptions(mesh.ClientConfig{Retry: retry.Config{Target: "svc"}, Metrics: mesh.NewClientMetrics(mreg)}))
	for range 200 {
		check(ctx, b, full)
		check(ctx, b, metrics)
	}
	setups := []*healthPair{bare, chain, metrics, full}
	dists := make([]Dist, len(setups))
	cpu := make([]time.Duration, len(setups)) // process CPU time over each setup's calls
	round := 0
	for b.Loop() {
		for i := range setups {
			j := (i + round) % len(setups) // rotate the order each round
			c0 := processCPU(b)
			for range chainRound {
				t0 := time.Now()
				check(ctx, b, setups[j])
				dists[j] = append(dists[j], time.Since(t0))
			}
			cpu[j] += processCPU(b) - c0
		}
		round++
	}
	p50 := func(d Dist) float64 { return float64(d.Quantile(0.5)) }
	b.ReportMetric(p50(dists[0])/1e3, "p50-bare-µs")
	b.ReportMetric(p50(dists[1])/1e3, "p50-chain-µs")
	b.ReportMetric(p50(dists[2])/1e3, "p50-metrics-µs")
	b.ReportMetric(p50(dists[3])/1e3, "p50-served-µs")
	b.ReportMetric(100*(p50(dists[1])/p50(dists[0])-1), "chain-overhead-%")
	b.ReportMetric(100*(p50(dists[2])/p50(dists[1])-1), "metrics-over-chain-%")
	b.ReportMetric(100*(p50(dists[3])/p50(dists[0])-1), "served-overhead-%")
	// CPU per call (client and server together, both in this process): less exposed to
	// the machine's other load than latency is, since time spent waiting for a core is
	// not counted.
	perCall := func(i int) float64 { return float64(cpu[i]) / float64(len(dists[i])) }
	b.ReportMetric(perCall(1)/1e3, "cpu-chain-µs")
	b.ReportMetric(perCall(2)/1e3, "cpu-metrics-µs")
	b.ReportMetric(100*(perCall(2)/perCall(1)-1), "cpu-metrics-over-chain-%")
}

// processCPU is the CPU time (user and system) this process has used so far.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
