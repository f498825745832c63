package e2e

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/decoderlease"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// Decoder leases across the real processes (docs/leases.md): runs complete with leases on
// (the default), a decoder nobody renews stops by itself with cause lease_expired, and one
// that is renewed outlives its TTL many times over.
func TestDecoderLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("run completes with leases on", func(t *testing.T) {
		t.Parallel()
		// Model steps decode for about 1.5 s, with a tool in between and a subagent.
		const plan = `{"tokens_per_second": 40, "steps": [
		  {"think_tokens": 60, "tools": [{"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [{"answer_tokens": 40}]}}}]},
		  {"answer_tokens": 60}]}`
		res, _ := runPlan(ctx, client(t), plan, 30*time.Second, 0, false)
		if res.err != nil {
			t.Fatalf("Run: %v", res.err)
		}
		r := res.finished
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("run did not succeed:\n%s", dump(r))
		}
		for _, id := range []string{"root/m0", "root/m1", "root/s0.t0/sub/m0"} {
			if n := nodeMap(r)[id]; n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
				t.Errorf("node %s = %v, want SUCCEEDED", id, n)
			}
		}
		if r.GetTokens() != 160 {
			t.Errorf("run tokens = %d, want 160", r.GetTokens())
		}
	})

	conn, err := mesh.ConnAs(meshtls.Orchestrator, "modelproxy") // as a caller of Generate; closed with the mesh
	if err != nil {
		t.Fatal(err)
	}
	mp := modelproxyv1.NewModelProxyServiceClient(conn)
	// generate calls modelproxy directly as the decoder of run/root/m0 with a lease TTL.
	generate := func(ctx context.Context, run, plan string, ttl time.Duration) (int, error) {
		ctx = metadata.AppendToOutgoingContext(ctx, md.RunID, run, md.NodeID, "root/m0", md.RetryID, "rid-"+run)
		st, err := mp.Generate(ctx, &modelproxyv1.GenerateRequest{Model: "sim", LeaseTtl: durationpb.New(ttl),
			Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: plan}}})
		if err != nil {
			return 0, err
		}
		tokens := 0
		for {
			resp, err := st.Recv()
			if errors.Is(err, io.EOF) {
				return tokens, nil
			}
			if err != nil {
				return tokens, err
			}
			tokens += int(resp.GetTokens())
		}
	}

	t.Run("unrenewed decoder stops by itself", func(t *testing.T) {
		t.Parallel()
		const run, ttl = "e2e-lease-lapse", 400 * time.Millisecond
		// 40 s of decode; the caller reads it all but never renews the lease, as a caller
		// whose cancel was lost would.
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		start := time.Now()
		tokens, err := generate(cctx, run, `{"tokens_per_second": 50, "steps": [{"answer_tokens": 2000}]}`, ttl)
		elapsed := time.Since(start)
		if status.Code(err) != codes.Canceled || !strings.Contains(status.Convert(err).Message(), "lease expired") {
			t.Fatalf("Generate = %v after %d tokens, want CANCELED: decoder lease expired", err, tokens)
		}
		if elapsed < ttl || elapsed > ttl+2*time.Second {
			t.Errorf("the decoder stopped after %v, want about its TTL %v", elapsed, ttl)
		}
		report, err := mesh.Report("modelproxy")
		if err != nil {
			t.Fatal(err)
		}
		resp, err := report.ListNodes(cctx, &meshv1.ListNodesRequest{RunId: run, SettleTimeout: durationpb.New(5 * time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		ns := resp.GetNodes()
		if len(ns) != 1 || ns[0].GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || ns[0].GetCause() != meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED {
			t.Fatalf("modelproxy's nodes of %s = %v, want root/m0 CANCELLED with cause LEASE_EXPIRED", run, ns)
		}
		if got := ns[0].GetTokens(); got != int64(tokens) {
			t.Errorf("ledger has %d tokens, the caller received %d", got, tokens)
		}
	})

	t.Run("renewed decoder outlives its TTL", func(t *testing.T) {
		t.Parallel()
		const run, ttl = "e2e-lease-renewed", 400 * time.Millisecond
		k := decoderlease.New(mp, decoderlease.Options{Period: 100 * time.Millisecond, TTL: ttl, Log: slog.New(slog.DiscardHandler)})
		cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		l := k.Hold(cctx, decoderlease.Key{RunID: run, NodeID: "root/m0", RetryID: "rid-" + run})
		start := time.Now()
		tokens, err := generate(cctx, run, `{"tokens_per_second": 50, "steps": [{"answer_tokens": 100}]}`, ttl)
		l.Release()
		if err != nil || tokens != 100 {
			t.Fatalf("Generate = %d tokens, %v; want all 100", tokens, err)
		}
		if d := time.Since(start); d < 4*ttl {
			t.Errorf("the decode took %v, want well past the TTL %v", d, ttl)
		}
		if s := k.Stats(); s.Calls < 10 || s.Failed != 0 {
			t.Errorf("keeper stats = %+v, want a renewal every 100ms", s)
		}
	})

	t.Run("lease age is exported", func(t *testing.T) {
		p := scrapeParsed(t, mesh, "modelproxy")
		mf, ok := p.mfs["curfew_lease_age_seconds"]
		if !ok || len(mf.GetMetric()) != 1 || mf.GetMetric()[0].GetGauge().GetValue() < 0 {
			t.Fatalf("curfew_lease_age_seconds = %v, want one gauge", mf)
		}
	})
}
