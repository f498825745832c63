package modelproxy

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// The token counter follows the ledger as tokens are emitted; orphan tokens are the
// ledger's tokens after the run's cancel instant, counted once, when a summary lists the
// node.
func TestTokenMetrics(t *testing.T) {
	reg := prometheus.NewRegistry()
	srv := newServer(t)
	srv.Metrics = NewMetrics(reg)
	cc := meshtest.Serve(t, mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, srv)
		meshv1.RegisterNodeReportServiceServer(gs, srv.Report())
	})
	tokens := srv.Metrics.tokens.WithLabelValues(SimModel, SimProvider)
	orphans := srv.Metrics.orphans.WithLabelValues(SimModel, SimProvider)
	if n := testutil.CollectAndCount(reg); n != 3 {
		t.Fatalf("%d series before any decode, want sim's 3 at 0 (output, prompt, orphan)", n)
	}
	before := time.Now()
	ctx, cancel := context.WithTimeout(ident("r-tok", "root/m0"), 10*time.Second)
	defer cancel()
	if _, err := generate(ctx, t, modelproxyv1.NewModelProxyServiceClient(cc), &modelproxyv1.GenerateRequest{
		Messages: conversation(`{"tokens_per_second": 1000, "steps": [{"answer_tokens": 7}]}`, 0)}); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(tokens); got != 7 {
		t.Errorf("tokens = %v, want 7", got)
	}
	// A cancel instant before the decode started: all 7 tokens came after it.
	report := meshv1.NewNodeReportServiceClient(cc)
	req := &meshv1.ListNodesRequest{RunId: "r-tok", CancelAt: timestamppb.New(before.Add(-time.Second))}
	for range 2 {
		resp, err := report.ListNodes(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if n := resp.GetNodes(); len(n) != 1 || n[0].GetTokensAfterCancel() != 7 {
			t.Fatalf("nodes %v, want root/m0 with 7 tokens after the cancel", n)
		}
	}
	if got := testutil.ToFloat64(orphans); got != 7 {
		t.Errorf("orphan tokens = %v, want 7, counted once over two summaries", got)
	}
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}
