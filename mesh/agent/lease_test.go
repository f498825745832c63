package agent_test

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/decoderlease"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// leaseModel is a model client over real gRPC that records the lease TTL of each
// Generate and answers RenewLeases itself, recording the keys of each call.
type leaseModel struct {
	modelproxyv1.ModelProxyServiceClient
	mu     sync.Mutex
	ttls   []time.Duration
	renews [][]string // run/node/retry-id, per call
}

func (m *leaseModel) Generate(ctx context.Context, in *modelproxyv1.GenerateRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[modelproxyv1.GenerateResponse], error) {
	m.mu.Lock()
	m.ttls = append(m.ttls, in.GetLeaseTtl().AsDuration())
	m.mu.Unlock()
	return m.ModelProxyServiceClient.Generate(ctx, in, opts...)
}

func (m *leaseModel) RenewLeases(_ context.Context, in *modelproxyv1.RenewLeasesRequest, _ ...grpc.CallOption) (*modelproxyv1.RenewLeasesResponse, error) {
	var keys []string
	for _, k := range in.GetKeys() {
		keys = append(keys, k.GetRunId()+"/"+k.GetNodeId()+"/"+k.GetRetryId())
	}
	slices.Sort(keys)
	m.mu.Lock()
	m.renews = append(m.renews, keys)
	m.mu.Unlock()
	return &modelproxyv1.RenewLeasesResponse{}, nil
}

func (m *leaseModel) snapshot() ([]time.Duration, [][]string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.ttls), slices.Clone(m.renews)
}

// leaseRig serves a scripted model (each step thinking for think first) and tools, and
// returns a config whose Model is a leaseModel, with a keeper renewing every 50 ms.
func leaseRig(t *testing.T, think time.Duration) (agent.Config, *leaseModel, *meshtest.Model) {
	wait := func(ctx context.Context) error {
		select {
		case <-time.After(think):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	model := meshtest.NewModel(meshtest.ModelStep{Before: wait, Text: "the answer"})
	mc := meshtest.Serve(t, mesh.ServerConfig{}, model.Register)
	tc := meshtest.Serve(t, mesh.ServerConfig{}, meshtest.NewTools(nil).Register)
	lm := &leaseModel{ModelProxyServiceClient: modelproxyv1.NewModelProxyServiceClient(mc)}
	return agent.Config{
		Model: lm, ModelNodes: meshv1.NewNodeReportServiceClient(mc),
		Tools: toolrunnerv1.NewToolRunnerServiceClient(tc), ToolNodes: meshv1.NewNodeReportServiceClient(tc),
		LeaseOptions: decoderlease.Options{Period: 50 * time.Millisecond},
	}, lm, model
}

func TestLoopHoldsDecoderLeaseWhileStreaming(t *testing.T) {
	cfg, lm, model := leaseRig(t, 300*time.Millisecond)
	ctx, cancel := runCtx(t, 10*time.Second)
	defer cancel()
	answer, err := agent.New(cfg).Run(ctx, "root", "", "task")
	if err != nil || answer != "the answer" {
		t.Fatalf("Run = %q, %v", answer, err)
	}
	calls := model.Calls()
	if len(calls) != 1 || calls[0].ID.RetryID == "" {
		t.Fatalf("model calls = %v, want one carrying the retry-id the loop minted", calls)
	}
	want := runID + "/root/m0/" + calls[0].ID.RetryID
	time.Sleep(50 * time.Millisecond) // a renewal in flight at the release completes
	ttls, renews := lm.snapshot()
	if !slices.Equal(ttls, []time.Duration{150 * time.Millisecond}) {
		t.Fatalf("lease_ttl sent = %v, want the keeper's 3 × 50ms", ttls)
	}
	if len(renews) < 3 {
		t.Fatalf("%d renewals of a 300ms decode every 50ms, want several", len(renews))
	}
	for _, keys := range renews {
		if !slices.Equal(keys, []string{want}) {
			t.Fatalf("renewal keys = %v, want [%s]", keys, want)
		}
	}
	// Released when the stream ended: the keeper holds nothing and renews no more.
	k := decoderlease.Shared(lm, cfg.LeaseOptions)
	if s := k.Stats(); s.Held != 0 || s.Calls != uint64(len(renews)) {
		t.Fatalf("keeper stats = %+v after the step, want nothing held, %d calls", s, len(renews))
	}
	time.Sleep(150 * time.Millisecond)
	if _, after := lm.snapshot(); len(after) != len(renews) {
		t.Fatalf("%d renewals after the step ended", len(after)-len(renews))
	}
}

// Loops made from the same model client, one per run as the orchestrator and the
// subagent service make them, renew through one keeper: their leases go in the same call.
func TestLoopsOfOneClientShareOneKeeper(t *testing.T) {
	cfg, lm, _ := leaseRig(t, 400*time.Millisecond)
	var wg sync.WaitGroup
	for _, run := range []string{"run-a", "run-b"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(md.WithIdentity(context.Background(), md.Identity{RunID: run, NodeID: "root"}), 10*time.Second)
			defer cancel()
			if _, err := agent.New(cfg).Run(ctx, "root", "", "task"); err != nil {
				t.Errorf("%s: %v", run, err)
			}
		}()
	}
	wg.Wait()
	_, renews := lm.snapshot()
	both := 0
	for _, keys := range renews {
		if len(keys) == 2 && keys[0][:5] == "run-a" && keys[1][:5] == "run-b" {
			both++
		}
	}
	if both < 3 {
		t.Fatalf("renewals = %v, want most carrying both runs' leases in one call", renews)
	}
}

// A cancelled step stops renewing at once, before its settle wait.
func TestLoopReleasesLeaseWhenCancelled(t *testing.T) {
	cfg, lm, _ := leaseRig(t, time.Hour)
	cfg.SettleTimeout = 2 * time.Second
	ctx, cancel := runCtx(t, 10*time.Second)
	defer cancel()
	time.AfterFunc(200*time.Millisecond, cancel)
	if _, err := agent.New(cfg).Run(ctx, "root", "", "task"); err == nil {
		t.Fatal("a cancelled run returned no error")
	}
	if s := decoderlease.Shared(lm, cfg.LeaseOptions).Stats(); s.Held != 0 || s.Calls < 2 {
		t.Fatalf("keeper stats = %+v, want renewals before the cancel and nothing held after", s)
	}
}
