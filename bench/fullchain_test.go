package bench

import (
	"io"
	"log/slog"
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
	round := 0
	for b.Loop() {
		for i := range setups {
			j := (i + round) % len(setups) // rotate the order each round
			for range chainRound {
				t0 := time.Now()
				check(ctx, b, setups[j])
				dists[j] = append(dists[j], time.Since(t0))
			}
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
}
