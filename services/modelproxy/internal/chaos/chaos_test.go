package chaos

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	meshchaos "github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/modelproxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serve serves a modelproxy that honours the curfew-chaos header, with the drill's faults
// wired in unless bare.
func serve(t *testing.T, bare bool) (*modelproxy.Server, modelproxyv1.ModelProxyServiceClient) {
	t.Helper()
	log := slog.New(slog.DiscardHandler)
	srv := modelproxy.New(storetest.OpenMemory(t))
	t.Cleanup(func() { _ = srv.Flush(context.Background()) }) // before the store closes
	srv.Log = log
	var svc modelproxyv1.ModelProxyServiceServer = srv
	if !bare {
		svc = Wire(srv)
	}
	cc := meshtest.Serve(t, mesh.ServerConfig{Chaos: true, Logger: log}, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, svc)
		meshv1.RegisterNodeReportServiceServer(gs, srv.Report())
	})
	return srv, modelproxyv1.NewModelProxyServiceClient(cc)
}

func ident(run, node, chaos string) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{RunID: run, NodeID: node, Chaos: chaos})
}

func request(planJSON string, leaseTTL time.Duration) *modelproxyv1.GenerateRequest {
	return &modelproxyv1.GenerateRequest{LeaseTtl: durationpb.New(leaseTTL),
		Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: planJSON}}}
}

// slowPlan decodes one token every 20 ms for 20 s.
const slowPlan = `{"tokens_per_second":50,"steps":[{"answer_tokens":1000}]}`

// startThenCancel starts a Generate under ctx, reads two tokens and cancels the call; it
// returns the cancel instant.
func startThenCancel(ctx context.Context, t *testing.T, c modelproxyv1.ModelProxyServiceClient, req *modelproxyv1.GenerateRequest) time.Time {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.Generate(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	at := time.Now()
	cancel()
	if _, err := meshtest.Drain(st); status.Code(err) != codes.Canceled {
		t.Fatalf("stream after cancel: %v, want CANCELED", err)
	}
	return at
}

// waitEnded waits until node of run has ended.
func waitEnded(t *testing.T, srv *modelproxy.Server, run, node string, within time.Duration) *meshv1.Node {
	t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		ns, _ := srv.Nodes.List(context.Background(), run, []string{node}, 0)
		for _, n := range ns {
			if n.GetId() == node && n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING {
				return n
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("node %s of %s has not ended within %v", node, run, within)
	return nil
}

// drop-cancel: the decoder outlives its call's cancel, and its lease's lapse stops it.
func TestDropCancelDecoderStoppedByLease(t *testing.T) {
	srv, c := serve(t, false)
	const run, node, ttl = "r-drop", "root/m0", 300 * time.Millisecond
	cancelAt := startThenCancel(ident(run, node, meshchaos.DropCancel), t, c, request(slowPlan, ttl))
	n := waitEnded(t, srv, run, node, 5*time.Second)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED {
		t.Fatalf("node = %v, want CANCELLED by LEASE_EXPIRED", n)
	}
	if n.GetCancelledAt() == nil {
		t.Fatalf("node %v has no cancelled_at", n)
	}
	if lived := n.GetEndedAt().AsTime().Sub(cancelAt); lived < ttl/2 {
		t.Fatalf("decoder ended %v after its call's cancel, want it to decode on until its lease lapsed (TTL %v)", lived, ttl)
	}
	if _, _, after := srv.Ledger.Figures(run, node, cancelAt); after < 3 {
		t.Fatalf("%d tokens after the cancel, want the dropped cancel's leak", after)
	}
}

// A modelproxy without Wire ignores the faults even when the header reaches it.
func TestBareServerHasNoFaults(t *testing.T) {
	srv, c := serve(t, true)
	const run, node = "r-bare", "root/m0"
	cancelAt := startThenCancel(ident(run, node, meshchaos.DropCancel+","+meshchaos.WorkerLedger), t, c, request(slowPlan, time.Minute))
	n := waitEnded(t, srv, run, node, 5*time.Second)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetEndedAt().AsTime().Sub(cancelAt) > time.Second {
		t.Fatalf("node = %v, want CANCELLED promptly", n)
	}
	if total, _, after := srv.Ledger.Figures(run, node, cancelAt); total < 2 || after > 1 {
		t.Fatalf("ledger of the task: %d tokens, %d after the cancel; want the call's, none leaked", total, after)
	}
}

// orphan: the decoder ignores its call's cancel and its lease, and decodes to the deadline.
func TestOrphanDecodesToDeadline(t *testing.T) {
	srv, c := serve(t, false)
	const run, node = "r-orphan", "root/m0"
	ctx, cancel := context.WithTimeout(ident(run, node, meshchaos.Orphan), 700*time.Millisecond)
	defer cancel()
	cancelAt := startThenCancel(ctx, t, c, request(slowPlan, 100*time.Millisecond))
	n := waitEnded(t, srv, run, node, 5*time.Second)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
		t.Fatalf("node = %v, want DEADLINE_EXCEEDED: neither the cancel nor the lease stopped it", n)
	}
	if _, _, after := srv.Ledger.Figures(run, node, cancelAt); after < 10 {
		t.Fatalf("%d tokens after the cancel, want decoding on to the deadline", after)
	}
}

// worker-ledger: the tokens are keyed by worker, not by the task.
func TestWorkerLedger(t *testing.T) {
	srv, c := serve(t, false)
	const run, node = "r-worker", "root/m0"
	before, _, _ := srv.Ledger.Figures(meshchaos.Worker(), "decoder", time.Time{})
	st, err := c.Generate(ident(run, node, meshchaos.WorkerLedger), request(`{"tokens_per_second":1000,"steps":[{"answer_tokens":5}]}`, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	chunks, err := meshtest.Drain(st)
	if err != nil || len(chunks) != 6 {
		t.Fatalf("streamed %d chunks, %v; want 5 tokens and the final chunk", len(chunks), err)
	}
	waitEnded(t, srv, run, node, 5*time.Second)
	if total, _, _ := srv.Ledger.Figures(run, node, time.Time{}); total != 0 {
		t.Fatalf("the task's ledger holds %d tokens, want 0", total)
	}
	if total, _, _ := srv.Ledger.Figures(meshchaos.Worker(), "decoder", time.Time{}); total-before != 5 {
		t.Fatalf("the worker's ledger grew by %d tokens, want 5", total-before)
	}
	if r, n := LedgerKey(ident(run, node, meshchaos.WorkerLedger), "smart", run, node); r != run || n != node {
		t.Fatalf("a routed model's key = %s, %s; want the task's: the faults are the sim model's", r, n)
	}
}

// no-dedupe: an attempt failed by model_error leaves a decoder running as NODE~a1, which
// only its lease's lapse stops.
func TestNoDedupeLeavesDecoder(t *testing.T) {
	srv, c := serve(t, false)
	const run, node, ttl = "r-dedupe", "root/m0", 300 * time.Millisecond
	p := `{"tokens_per_second":50,"steps":[{"answer_tokens":1000,"model_error":{"attempts":1}}]}`
	st, err := c.Generate(ident(run, node, meshchaos.NoDedupe), request(p, ttl))
	if err == nil {
		_, err = meshtest.Drain(st)
	}
	meshtest.WantCode(t, err, codes.Unavailable, "injected error on attempt 1")
	first := waitEnded(t, srv, run, node, 5*time.Second)
	if first.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || first.GetRetryId() == "" {
		t.Fatalf("attempt's node = %v, want FAILED, with a retry-id", first)
	}
	const left = node + "~a1"
	n := waitEnded(t, srv, run, left, 5*time.Second)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED ||
		n.GetRetryId() != first.GetRetryId() || n.GetAttempt() != 1 || n.GetName() != modelproxy.SimModel {
		t.Fatalf("leftover node = %v, want a sim node of the attempt's retry-id, attempt 1, CANCELLED by LEASE_EXPIRED", n)
	}
	if total, _, _ := srv.Ledger.Figures(run, left, time.Time{}); total < 5 {
		t.Fatalf("leftover decoded %d tokens, want it to decode until its lease lapsed", total)
	}
	// The cancel broadcast reaches the leftover's node but does not stop its decoder.
	srv2, c2 := serve(t, false)
	st, err = c2.Generate(ident(run, node, meshchaos.NoDedupe), request(p, ttl))
	if err == nil {
		_, _ = meshtest.Drain(st)
	}
	deadline := time.Now().Add(5 * time.Second)
	for srv2.Nodes.Cancel(run, []string{left}, context.Canceled) == 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := waitEnded(t, srv2, run, left, 5*time.Second); n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED {
		t.Fatalf("leftover after a broadcast = %v, want it stopped by its lease only", n)
	}
}
