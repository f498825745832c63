package bench

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// tracingPairs returns the pairs the tracing benchmarks compare, all with the curfew chain
// on both sides (as BenchmarkChain's Chain): without tracing (chain); with the tracing
// options a service installs when no OTEL_* variable is set (off); with the tracing
// handlers of a no-op provider, which record nothing but still make grpc-go report every
// call's events (noop: what off cost before it installed nothing); and, when CURFEW_OTELCOL
// names an OpenTelemetry Collector, with tracing on, exporting every span over OTLP/gRPC
// to that collector on loopback (export; nil without CURFEW_OTELCOL).
func tracingPairs(b *testing.B) (chain, off, noop, export *healthPair, ctx context.Context) {
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	pair := func(p *tracing.Provider) *healthPair {
		sopts, dopts := mesh.ServerOptions(mesh.ServerConfig{Logger: quiet}), mesh.DialOptions(mesh.ClientConfig{})
		if p != nil {
			sopts = append(sopts, p.ServerOption())
			dopts = append(dopts, p.DialOption())
		}
		return newHealthPair(b, sopts, dopts)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	b.Cleanup(cancel)
	chain = pair(nil)
	offP, err := tracing.FromEnv(ctx, "bench", func(string) string { return "" })
	if err != nil || offP.Enabled() {
		b.Fatalf("tracing without OTEL_* variables: enabled %v, %v", offP.Enabled(), err)
	}
	off = pair(offP)
	noop = newHealthPair(b, append(mesh.ServerOptions(mesh.ServerConfig{Logger: quiet}), grpc.StatsHandler(tracing.ServerHandler(offP))),
		append(mesh.DialOptions(mesh.ClientConfig{}), grpc.WithStatsHandler(tracing.ClientHandler(offP))))
	if bin := os.Getenv("CURFEW_OTELCOL"); bin != "" {
		addr := startBenchCollector(b, bin)
		b.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+addr)
		b.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
		onP, err := tracing.FromEnv(ctx, "bench", os.Getenv)
		if err != nil || !onP.Enabled() {
			b.Fatalf("tracing with an OTLP endpoint: enabled %v, %v", onP.Enabled(), err)
		}
		b.Cleanup(func() {
			sctx, stop := context.WithTimeout(context.Background(), 10*time.Second)
			defer stop()
			if err := onP.Shutdown(sctx); err != nil {
				b.Errorf("flushing spans: %v", err)
			}
		})
		export = pair(onP)
	}
	ctx = md.WithIdentity(ctx, md.Identity{Tenant: "bench", RunID: "0198c0de-0000-7000-8000-000000000000", NodeID: "root/s0.t0/sub/m0"})
	for _, p := range []*healthPair{chain, off, noop, export} {
		if p == nil {
			continue
		}
		for range 200 { // connect and warm up
			check(ctx, b, p)
		}
	}
	return chain, off, noop, export, ctx
}

// BenchmarkChainTracing reports ns/op and allocations of the same unary Check through the
// curfew chain without tracing handlers, with them and tracing off, and with them
// exporting to a collector (with CURFEW_OTELCOL).
func BenchmarkChainTracing(b *testing.B) {
	chain, off, noop, export, ctx := tracingPairs(b)
	for _, c := range []struct {
		name string
		p    *healthPair
	}{{"Chain", chain}, {"Off", off}, {"Noop", noop}, {"Export", export}} {
		if c.p == nil {
			continue
		}
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				check(ctx, b, c.p)
			}
		})
	}
}

// BenchmarkChainTracingLatency times every call of the setups of BenchmarkChainTracing,
// interleaved like BenchmarkChainLatency: each iteration is one round of chainRound calls
// per setup, the order rotating by round. Run it with -benchtime=<rounds>x.
func BenchmarkChainTracingLatency(b *testing.B) {
	chain, off, noop, export, ctx := tracingPairs(b)
	setups := []struct {
		name string
		p    *healthPair
		d    Dist
	}{{"chain", chain, nil}, {"off", off, nil}, {"noop", noop, nil}, {"export", export, nil}}
	if export == nil {
		setups = setups[:3]
	}
	round := 0
	for b.Loop() {
		for i := range setups {
			s := &setups[(i+round)%len(setups)]
			for range chainRound {
				t0 := time.Now()
				check(ctx, b, s.p)
				s.d = append(s.d, time.Since(t0))
			}
		}
		round++
	}
	base := setups[0].d.Quantile(.5)
	var sb strings.Builder
	fmt.Fprintf(&sb, "\ntracing on the curfew chain: unary health Check on loopback TCP, %d calls each, interleaved in rounds of %d\n", len(setups[0].d), chainRound)
	fmt.Fprintf(&sb, "| setup | p50 µs | p90 µs | p99 µs | p50 vs chain |\n|---|---:|---:|---:|---:|\n")
	for _, s := range setups {
		p50 := s.d.Quantile(.5)
		over := 100 * (float64(p50)/float64(base) - 1)
		b.ReportMetric(float64(p50)/1e3, "p50-"+s.name+"-µs")
		if s.name != "chain" {
			b.ReportMetric(over, "p50-"+s.name+"-overhead-%")
		}
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %+.1f %% |\n", s.name, us(p50), us(s.d.Quantile(.9)), us(s.d.Quantile(.99)), over)
	}
	addReport(sb.String())
}

// startBenchCollector starts the collector at bin with an OTLP/gRPC receiver on a free
// loopback port and the debug exporter at basic verbosity (a line per batch, discarded),
// and returns the receiver's address.
func startBenchCollector(b *testing.B, bin string) string {
	b.Helper()
	dir := b.TempDir()
	for range 5 { // the port is picked free, then bound by the collector: retry a lost race
		var lc net.ListenConfig
		l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		addr := l.Addr().String()
		_ = l.Close()
		cfg := filepath.Join(dir, "config.yaml")
		if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`receivers:
  otlp:
    protocols:
      grpc:
        endpoint: %s
exporters:
  debug:
    verbosity: basic
    use_internal_logger: false
    output_paths: [%q]
service:
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [debug]
`, addr, os.DevNull)), 0o600); err != nil {
			b.Fatal(err)
		}
		cmd := exec.Command(bin, "--config", cfg) //nolint:noctx // stopped with SIGTERM in Cleanup
		cmd.Stdout, cmd.Stderr = io.Discard, os.Stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		for wait := time.Now().Add(30 * time.Second); time.Now().Before(wait); time.Sleep(50 * time.Millisecond) {
			select {
			case <-done:
			default:
				d := net.Dialer{Timeout: time.Second}
				if c, err := d.DialContext(context.Background(), "tcp", addr); err == nil {
					_ = c.Close()
					b.Cleanup(func() {
						_ = cmd.Process.Signal(syscall.SIGTERM)
						select {
						case <-done:
						case <-time.After(30 * time.Second):
							_ = cmd.Process.Kill()
							<-done
						}
					})
					return addr
				}
				continue
			}
			break
		}
		_ = cmd.Process.Kill()
		<-done
	}
	b.Fatal("the collector did not start")
	return ""
}
