package bench

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// healthPair is one server and one client connection on loopback TCP, serving grpc
// health.
type healthPair struct {
	srv    *grpc.Server
	conn   *grpc.ClientConn
	client healthpb.HealthClient
}

func newHealthPair(tb testing.TB, sopts []grpc.ServerOption, dopts []grpc.DialOption) *healthPair {
	tb.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	srv := grpc.NewServer(sopts...)
	hs := health.NewServer()
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(srv, hs)
	go func() { _ = srv.Serve(lis) }()
	// Plaintext unless dopts bring their own transport credentials (the last one wins).
	conn, err := grpc.NewClient(lis.Addr().String(), append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, dopts...)...)
	if err != nil {
		tb.Fatal(err)
	}
	p := &healthPair{srv: srv, conn: conn, client: healthpb.NewHealthClient(conn)}
	tb.Cleanup(func() { _ = conn.Close(); srv.Stop() })
	return p
}

// chainPairs returns the bare pair (no interceptors) and the curfew pair (mesh.ServerOptions
// with the services' deadline policy, mesh.DialOptions), plus the context every call uses:
// a run's identity and a deadline, as calls inside the mesh carry them. The bare client
// ignores the identity; both send grpc-timeout.
func chainPairs(tb testing.TB) (bare, chain *healthPair, ctx context.Context) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	bare = newHealthPair(tb, nil, nil)
	chain = newHealthPair(tb, mesh.ServerOptions(mesh.ServerConfig{Logger: quiet}), mesh.DialOptions(mesh.ClientConfig{}))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	tb.Cleanup(cancel)
	ctx = md.WithIdentity(ctx, md.Identity{Tenant: "bench", RunID: "0198c0de-0000-7000-8000-000000000000", NodeID: "root/s0.t0/sub/m0"})
	for _, p := range []*healthPair{bare, chain} {
		for range 200 { // connect and warm up
			check(ctx, tb, p)
		}
	}
	return bare, chain, ctx
}

var checkReq = &healthpb.HealthCheckRequest{}

func check(ctx context.Context, tb testing.TB, p *healthPair) {
	resp, err := p.client.Check(ctx, checkReq)
	if err != nil {
		tb.Fatal(err)
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		tb.Fatalf("status %v", resp.GetStatus())
	}
}

// BenchmarkChain compares ns/op (and allocations, client and server both being in this
// process) of a unary health Check through the curfew chain and through bare grpc-go.
// Compare the two with benchstat (scripts/bench.sh does).
func BenchmarkChain(b *testing.B) {
	bare, chain, ctx := chainPairs(b)
	for _, c := range []struct {
		name string
		p    *healthPair
	}{{"Bare", bare}, {"Chain", chain}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				check(ctx, b, c.p)
			}
		})
	}
}

// chainRound is how many calls each side makes per round of BenchmarkChainLatency.
const chainRound = 200

// BenchmarkChainLatency measures per-call latency percentiles of the same two setups,
// interleaved so that both see the same machine noise: each iteration is one round of
// chainRound bare calls and chainRound chain calls, the order alternating by round.
// Run it with -benchtime=<rounds>x; the metrics are over all calls of the run.
func BenchmarkChainLatency(b *testing.B) {
	bare, chain, ctx := chainPairs(b)
	var dBare, dChain Dist
	round := 0
	timeCalls := func(p *healthPair, into *Dist) {
		for range chainRound {
			t0 := time.Now()
			check(ctx, b, p)
			*into = append(*into, time.Since(t0))
		}
	}
	for b.Loop() {
		if round%2 == 0 {
			timeCalls(bare, &dBare)
			timeCalls(chain, &dChain)
		} else {
			timeCalls(chain, &dChain)
			timeCalls(bare, &dBare)
		}
		round++
	}
	for _, q := range []struct {
		name string
		q    float64
	}{{"p50", 0.50}, {"p90", 0.90}, {"p99", 0.99}} {
		vb, vc := dBare.Quantile(q.q), dChain.Quantile(q.q)
		b.ReportMetric(float64(vb)/1e3, q.name+"-bare-µs")
		b.ReportMetric(float64(vc)/1e3, q.name+"-chain-µs")
		if q.name == "p50" {
			b.ReportMetric(100*(float64(vc)/float64(vb)-1), "p50-overhead-%")
		}
	}
	printChainTable(dBare, dChain)
}

// BenchmarkChainHeaderFloor measures what curfew's headers alone cost, without any
// interceptor: bare grpc-go on both sides, the same calls as BenchmarkChainLatency's bare
// ones, and the same calls carrying the six headers the chain sends (curfew-tenant,
// curfew-run-id, curfew-node-id, curfew-deadline, curfew-retry-id, curfew-attempt), the
// retry-id minted per call as the retry layer does. Interleaved in rounds like
// BenchmarkChainLatency; run it with -benchtime=<rounds>x.
func BenchmarkChainHeaderFloor(b *testing.B) {
	bare, _, ctx := chainPairs(b)
	headers := withHeaders(ctx)
	var dBare, dHdr Dist
	round := 0
	timeCalls := func(withHeaders bool, into *Dist) {
		for range chainRound {
			t0 := time.Now()
			c := ctx
			if withHeaders {
				c = headers()
			}
			check(c, b, bare)
			*into = append(*into, time.Since(t0))
		}
	}
	for b.Loop() {
		if round%2 == 0 {
			timeCalls(false, &dBare)
			timeCalls(true, &dHdr)
		} else {
			timeCalls(true, &dHdr)
			timeCalls(false, &dBare)
		}
		round++
	}
	vb, vh := dBare.Quantile(.5), dHdr.Quantile(.5)
	b.ReportMetric(float64(vb)/1e3, "p50-bare-µs")
	b.ReportMetric(float64(vh)/1e3, "p50-headers-µs")
	b.ReportMetric(100*(float64(vh)/float64(vb)-1), "p50-overhead-%")
}

// newUUIDv7 returns a fresh UUIDv7 string, as the retry layer mints one per logical call.
func newUUIDv7() string {
	var u [16]byte
	_, _ = rand.Read(u[:])
	var ms [8]byte
	binary.BigEndian.PutUint64(ms[:], uint64(time.Now().UnixMilli())) //nolint:gosec // a positive Unix time
	copy(u[:6], ms[2:])
	u[6] = 0x70 | u[6]&0x0f
	u[8] = 0x80 | u[8]&0x3f
	var s [36]byte
	hex.Encode(s[0:8], u[0:4])
	hex.Encode(s[9:13], u[4:6])
	hex.Encode(s[14:18], u[6:8])
	hex.Encode(s[19:23], u[8:10])
	hex.Encode(s[24:], u[10:])
	s[8], s[13], s[18], s[23] = '-', '-', '-', '-'
	return string(s[:])
}

func printChainTable(dBare, dChain Dist) {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nunary health Check on loopback TCP, %d calls each, interleaved in rounds of %d\n", len(dBare), chainRound)
	fmt.Fprintf(&sb, "| setup | p50 µs | p90 µs | p99 µs | max µs |\n|---|---:|---:|---:|---:|\n")
	for _, r := range []struct {
		name string
		d    Dist
	}{{"bare grpc-go", dBare}, {"curfew chain", dChain}} {
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s |\n", r.name, us(r.d.Quantile(.5)), us(r.d.Quantile(.9)), us(r.d.Quantile(.99)), us(r.d.Max()))
	}
	fmt.Fprintf(&sb, "p50 overhead of the chain: %+.1f %%\n", 100*(float64(dChain.Quantile(.5))/float64(dBare.Quantile(.5))-1))
	addReport(sb.String())
}
