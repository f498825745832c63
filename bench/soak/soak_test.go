package soak

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

func TestMain(m *testing.M) {
	code := m.Run()
	meshproc.Cleanup()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// A short load of every kind on a real mesh under `curfew up`: each kind ends as its
// plan says, nothing is lost or duplicated, no decoder decodes more than a token after
// its cancel, and the processes' goroutines return to their count after the warm-up.
func TestDriveARealMesh(t *testing.T) {
	if testing.Short() {
		t.Skip("starts the mesh")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const concurrency = 8
	m, record, err := StartMesh(ctx, t.TempDir(), concurrency, "", os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = m.Stop() }()
	orch, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	if err := WaitForTool(ctx, orch, MCPTool); err != nil {
		t.Fatal(err)
	}
	mix := DefaultMix()
	mix.MCPTool = MCPTool
	mix.StepTokens, mix.TokensPerSecond, mix.ToolMS = 10, 1000, 10
	mix.LongTokensPerSecond = 40 // the e2e tests' rate for "at most one token after a cancel"
	mix.CancelMin, mix.CancelMax, mix.DeadlineTimeout = 200*time.Millisecond, 400*time.Millisecond, 400*time.Millisecond
	rep, err := Drive(ctx, Config{Orchestrators: []orchestratorv1.OrchestratorServiceClient{orch}, Processes: Processes(m),
		Concurrency: concurrency, Duration: 4 * time.Second, Mix: mix, Seed: 7, Warmup: time.Second, Settle: 2 * time.Second,
		Effects: func() (Effects, error) { return EffectsFromRecord(record) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + rep.Summary())
	want := map[Kind]string{Tools: "SUCCEEDED", MCP: "SUCCEEDED", Subagent: "SUCCEEDED", Failing: "FAILED/INVALID_ARGUMENT",
		Cancelled: "CANCELLED", Deadline: "DEADLINE_EXCEEDED"}
	for k, outcome := range want {
		kr := rep.Kinds[k]
		if kr.Runs == 0 || kr.Outcomes[outcome] != kr.Runs {
			t.Errorf("%s: %d runs, outcomes %v; want every one %s", k, kr.Runs, kr.Outcomes, outcome)
		}
	}
	if rep.Effects == nil || rep.Effects.Calls == 0 {
		t.Errorf("effects %+v: the MCP server saw no call", rep.Effects)
	}
	if rep.CancelLatency.N == 0 || rep.DeadlineOvershoot.N == 0 {
		t.Errorf("cancel latency %+v, deadline overshoot %+v: measured none", rep.CancelLatency, rep.DeadlineOvershoot)
	}
	for _, c := range rep.Checks {
		if !c.OK {
			t.Errorf("check failed: %s: %s", c.Name, c.Detail)
		}
	}
}
