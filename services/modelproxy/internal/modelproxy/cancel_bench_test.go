package modelproxy

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store/sqlite"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// BenchmarkCancelDecoders is modelproxy's share of the mesh's cancel benchmark
// (bench.BenchmarkCancelPropagation), in one process: 64 decoders of one run stream at
// 40 tokens/s over loopback gRPC through the mesh chain; once each has sent a token,
// CancelNodes stops them all, as the orchestrator's decoders-first cancel does, and then
// the callers cancel their streams (the RST_STREAMs of the hop-by-hop teardown). It
// reports the time from the CancelNodes call to the first and the last decoder ending
// (their nodes' ended_at), p50 and p99 over the iterations, with the ledger
// persisted to the private memory store of a modelproxy without --store, and to SQLite
// as under `curfew up`.
//
//	go test -run '^$' -bench BenchmarkCancelDecoders -benchtime 100x ./internal/modelproxy/
func BenchmarkCancelDecoders(b *testing.B) {
	for _, durable := range []bool{false, true} {
		b.Run(fmt.Sprintf("leaves=64/store=%v", map[bool]string{false: "memory", true: "sqlite"}[durable]), func(b *testing.B) {
			st := storetest.OpenMemory(b)
			if durable {
				var err error
				if st, err = sqlite.Open(b.Context(), filepath.Join(b.TempDir(), "curfew.db")); err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { _ = st.Close() })
			}
			srv := New(st)
			srv.Log = slog.New(slog.DiscardHandler)
			b.Cleanup(func() { _ = srv.Flush(context.Background()) })
			cc := meshtest.Serve(b, mesh.ServerConfig{Logger: srv.Log}, func(gs *grpc.Server) {
				modelproxyv1.RegisterModelProxyServiceServer(gs, srv)
				meshv1.RegisterNodeReportServiceServer(gs, srv.Report())
			})
			model, report := modelproxyv1.NewModelProxyServiceClient(cc), meshv1.NewNodeReportServiceClient(cc)
			var first, last []time.Duration
			for i := range b.N {
				f, l := cancelDecoders(b, model, report, fmt.Sprintf("r-bench-%d", i), 64)
				first, last = append(first, f), append(last, l)
			}
			for _, q := range []struct {
				name string
				d    []time.Duration
			}{{"first", first}, {"last", last}} {
				slices.Sort(q.d)
				b.ReportMetric(float64(q.d[len(q.d)/2].Microseconds())/1000, q.name+"-p50-ms")
				b.ReportMetric(float64(q.d[(len(q.d)*99+99)/100-1].Microseconds())/1000, q.name+"-p99-ms")
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}

// cancelDecoders runs one iteration: n decoders of run, cancelled together; it returns the
// time from the cancel to the first and the last ending.
func cancelDecoders(b *testing.B, model modelproxyv1.ModelProxyServiceClient, report meshv1.NodeReportServiceClient, run string, n int) (first, last time.Duration) {
	b.Helper()
	ctx, stop := context.WithCancel(b.Context())
	defer stop()
	const p = `{"tokens_per_second":40,"steps":[{"answer_tokens":4000}]}`
	var started, ended sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		started.Add(1)
		ended.Add(1)
		cctx := md.WithIdentity(ctx, md.Identity{Tenant: testTenant, RunID: run, NodeID: fmt.Sprintf("root/s%d/m0", i)})
		go func() {
			defer ended.Done()
			st, err := model.Generate(cctx, &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)})
			if err == nil {
				_, err = st.Recv()
			}
			started.Done()
			if err != nil {
				errs <- err
				return
			}
			for err == nil {
				_, err = st.Recv()
			}
		}()
	}
	started.Wait()
	select {
	case err := <-errs:
		b.Fatal(err)
	default:
	}
	time.Sleep(100 * time.Millisecond) // steady state: every decoder waits for its next token
	t0 := time.Now()
	if _, err := report.CancelNodes(ctx, &meshv1.CancelNodesRequest{RunId: run, Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR}); err != nil {
		b.Fatal(err)
	}
	stop() // the callers' streams end too
	ended.Wait()
	resp, err := report.ListNodes(b.Context(), &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(5 * time.Second)})
	if err != nil {
		b.Fatal(err)
	}
	if len(resp.GetNodes()) != n || !resp.GetSettled() {
		b.Fatalf("%d nodes (settled %v), want %d ended", len(resp.GetNodes()), resp.GetSettled(), n)
	}
	first = time.Hour
	for _, nd := range resp.GetNodes() {
		d := nd.GetEndedAt().AsTime().Sub(t0)
		first, last = min(first, d), max(last, d)
	}
	return first, last
}
