package bench

import (
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// servedPair is the hop as the services run it (BenchmarkChainAsServed's "served":
// chain, breaker, gRPC metrics), plaintext, or with what --tls-dir adds: the toolrunner's
// server credentials (client certificates required) and its call-graph policy in the
// chain, and the orchestrator's client credentials from dir.
func servedPair(b *testing.B, dir string) *healthPair {
	b.Helper()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	reg := prometheus.NewRegistry()
	scfg := mesh.ServerConfig{Logger: quiet, Metrics: mesh.NewServerMetrics(reg)}
	var sopts []grpc.ServerOption
	dopts := mesh.DialOptions(mesh.ClientConfig{Retry: retry.Config{Target: meshtls.ToolRunner}, Breakers: breaker.NewSet(breaker.Config{}, reg),
		Metrics: mesh.NewClientMetrics(reg)})
	if dir != "" {
		ssrc, err := meshtls.NewSource(dir, meshtls.ToolRunner, meshtls.WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		csrc, err := meshtls.NewSource(dir, meshtls.Orchestrator, meshtls.WithLogger(quiet))
		if err != nil {
			b.Fatal(err)
		}
		pol, err := meshtls.DefaultPolicy(meshtls.ToolRunner)
		if err != nil {
			b.Fatal(err)
		}
		scfg.Authorize = pol.Authorize
		sopts = append(sopts, grpc.Creds(meshtls.ServerCredentials(ssrc, meshtls.RequireClientCert)))
		dopts = append(dopts, grpc.WithTransportCredentials(meshtls.ClientCredentials(csrc, meshtls.ToolRunner)))
	}
	return newHealthPair(b, append(mesh.ServerOptions(scfg), sopts...), dopts)
}

// BenchmarkHopMTLS compares the hop as served in plaintext (curfew up --insecure) with the
// same hop over mTLS (curfew up's default): established connections, a unary health
// Check, interleaved in rounds of chainRound calls with the order alternating. The
// target: p50 with mTLS ≤ 1.3 × plaintext. Run it with -benchtime=<rounds>x.
//
//	go test -run '^$' -bench '^BenchmarkHopMTLS$' -benchtime 100x -count 3 ./bench/
func BenchmarkHopMTLS(b *testing.B) {
	dir := b.TempDir()
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		b.Fatal(err)
	}
	for _, id := range []string{meshtls.ToolRunner, meshtls.Orchestrator} {
		if err := ca.Issue(dir, id, 0); err != nil {
			b.Fatal(err)
		}
	}
	_, _, ctx := chainPairs(b) // the calls' context: a run's identity and a deadline
	plain, mtls := servedPair(b, ""), servedPair(b, dir)
	for range 200 { // connect, handshake and warm up
		check(ctx, b, plain)
		check(ctx, b, mtls)
	}
	setups := []*healthPair{plain, mtls}
	dists := make([]Dist, len(setups))
	round := 0
	for b.Loop() {
		for i := range setups {
			j := (i + round) % len(setups)
			for range chainRound {
				t0 := time.Now()
				check(ctx, b, setups[j])
				dists[j] = append(dists[j], time.Since(t0))
			}
		}
		round++
	}
	q := func(d Dist, p float64) float64 { return float64(d.Quantile(p)) }
	b.ReportMetric(q(dists[0], .5)/1e3, "p50-plain-µs")
	b.ReportMetric(q(dists[1], .5)/1e3, "p50-mtls-µs")
	b.ReportMetric(q(dists[1], .5)/q(dists[0], .5), "p50-mtls/plain")
	b.ReportMetric(q(dists[0], .99)/1e3, "p99-plain-µs")
	b.ReportMetric(q(dists[1], .99)/1e3, "p99-mtls-µs")
}
