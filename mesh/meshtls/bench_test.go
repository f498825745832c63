package meshtls_test

import (
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// BenchmarkUnaryPlaintext and BenchmarkUnaryTLS measure one health Check over loopback,
// on one connection made beforehand: plaintext, and mTLS with toolrunner's credentials
// and default policy (the orchestrator calling). serial reports the median latency
// (p50-ns) as well; parallel runs GOMAXPROCS callers. docs/benchmarks.md records the
// ratio.
func BenchmarkUnaryPlaintext(b *testing.B) {
	benchmarkUnary(b, nil, nil, insecureCreds())
}

func BenchmarkUnaryTLS(b *testing.B) {
	m := newMesh(b)
	pol, err := meshtls.DefaultPolicy(meshtls.ToolRunner)
	if err != nil {
		b.Fatal(err)
	}
	benchmarkUnary(b, meshtls.ServerCredentials(m.source(b, meshtls.ToolRunner), meshtls.RequireClientCert), pol,
		meshtls.ClientCredentials(m.source(b, meshtls.Orchestrator), meshtls.ToolRunner))
}

func benchmarkUnary(b *testing.B, sc credentials.TransportCredentials, pol *meshtls.Policy, cc credentials.TransportCredentials) {
	var opts []grpc.ServerOption
	if sc != nil {
		opts = append(opts, grpc.Creds(sc), grpc.UnaryInterceptor(pol.UnaryServerInterceptor()))
	}
	srv := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	client := healthpb.NewHealthClient(dial(b, listenAndServe(b, srv), cc))
	req := &healthpb.HealthCheckRequest{}
	if _, err := client.Check(b.Context(), req); err != nil { // connect
		b.Fatal(err)
	}

	b.Run("serial", func(b *testing.B) {
		lat := make([]time.Duration, 0, 1<<16)
		for b.Loop() {
			start := time.Now()
			if _, err := client.Check(b.Context(), req); err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(start))
		}
		slices.Sort(lat)
		b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	})
	b.Run("parallel", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if _, err := client.Check(b.Context(), req); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}
