package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// mesh is the one mesh every test in this package drives; runs are independent, so the
// tests share it and run in parallel.
var mesh *meshproc.Mesh

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	dir, err := os.MkdirTemp("", "curfew-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	mesh, err = meshproc.Start(ctx, dir, meshproc.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "start mesh:", err)
		return 1
	}
	code := m.Run()
	if err := mesh.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "curfew up did not stop cleanly:", err)
		code = 1
	}
	meshproc.Cleanup()
	removeMCPTest()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goroutine leak:", err)
			code = 1
		}
	}
	return code
}

// startOwnMesh starts a mesh of the test's own, with env added to curfew up's
// environment, and stops it when the test ends.
func startOwnMesh(t *testing.T, env ...string) *meshproc.Mesh {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	m, err := meshproc.Start(ctx, t.TempDir(), meshproc.Options{Env: env})
	if err != nil {
		t.Fatalf("start a mesh: %v", err)
	}
	t.Cleanup(func() {
		if err := m.Stop(); err != nil {
			t.Errorf("curfew up did not stop cleanly: %v", err)
		}
	})
	return m
}

func client(t *testing.T) orchestratorv1.OrchestratorServiceClient {
	t.Helper()
	c, err := mesh.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// result is what a client saw of one Run call.
type result struct {
	started  *orchestratorv1.RunStarted
	startAt  time.Time // when the started event reached the client
	nodes    []*meshv1.Node
	finished *orchestratorv1.Run // nil when the call ended without the summary
	err      error               // the call's final status (nil on success)
	errAt    time.Time           // when the final status reached the client
}

// runPlan calls Run with the plan and a client-side deadline. If cancelAt > 0 the client
// disconnects (cancels the call) that long after the call started, and cancelled is the

// runToSummary runs req on oc and returns its summary, failing the test if the call
// fails or the stream ends without one.
func runToSummary(ctx context.Context, t *testing.T, oc orchestratorv1.OrchestratorServiceClient, req *orchestratorv1.RunRequest) *orchestratorv1.Run {
	t.Helper()
	st, err := oc.Run(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	for {
		ev, err := st.Recv()
		if err != nil {
			t.Fatalf("run: %v", err)
		}
		if fin := ev.GetFinished(); fin != nil {
			return fin
		}
	}
}

// instant it did so.
func runPlan(ctx context.Context, c orchestratorv1.OrchestratorServiceClient, plan string, dl, cancelAt time.Duration, cont bool) (res result, cancelled time.Time) {
	cctx, cancel := context.WithTimeout(ctx, dl)
	defer cancel()
	var mu sync.Mutex
	if cancelAt > 0 {
		t := time.AfterFunc(cancelAt, func() {
			mu.Lock()
			cancelled = time.Now()
			mu.Unlock()
			cancel()
		})
		defer t.Stop()
	}
	st, err := c.Run(cctx, &orchestratorv1.RunRequest{Task: plan, ContinueOnDisconnect: cont})
	if err != nil {
		res.err, res.errAt = err, time.Now()
		return res, cancelled
	}
	for {
		ev, err := st.Recv()
		if err != nil {
			res.errAt = time.Now()
			if !errors.Is(err, io.EOF) {
				res.err = err
			}
			mu.Lock()
			defer mu.Unlock()
			return res, cancelled
		}
		switch e := ev.GetEvent().(type) {
		case *orchestratorv1.RunResponse_Started:
			res.started, res.startAt = e.Started, time.Now()
		case *orchestratorv1.RunResponse_Node:
			res.nodes = append(res.nodes, e.Node)
		case *orchestratorv1.RunResponse_Finished:
			res.finished = e.Finished
		}
	}
}

// summary waits for the run to end and returns its summary.
func summary(ctx context.Context, t *testing.T, c orchestratorv1.OrchestratorServiceClient, id string) *orchestratorv1.Run {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		resp, err := c.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
		if err != nil {
			t.Fatalf("GetRun %s: %v", id, err)
		}
		if resp.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return resp.GetRun()
		}
		select {
		case <-ctx.Done():
			t.Fatalf("run %s did not end", id)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func nodeMap(r *orchestratorv1.Run) map[string]*meshv1.Node {
	m := map[string]*meshv1.Node{}
	for _, n := range r.GetNodes() {
		m[n.GetId()] = n
	}
	return m
}

func dump(r *orchestratorv1.Run) string {
	s := fmt.Sprintf("run %s status=%s cause=%s err=%s %q cancelled_at=%v deadline=%v\n", r.GetRunId(), r.GetStatus(), r.GetCause(),
		r.GetErrorCode(), r.GetErrorMessage(), fmtTime(r.GetCancelledAt().AsTime()), fmtTime(r.GetDeadline().AsTime()))
	for _, n := range r.GetNodes() {
		s += fmt.Sprintf("  %-28s %-20s %-22s %-30s tok=%d at=%d after=%d start=%s end=%s dl=%s\n", n.GetId(), n.GetKind(), n.GetStatus(), n.GetCause(),
			n.GetTokens(), n.GetTokensAtCancel(), n.GetTokensAfterCancel(), fmtTime(n.GetStartedAt().AsTime()), fmtTime(n.GetEndedAt().AsTime()), fmtTime(n.GetDeadline().AsTime()))
	}
	return s
}

func fmtTime(t time.Time) string { return t.Format("15:04:05.000000") }

func code(err error) string { return status.Code(err).String() }
