package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/cli"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// syncBuffer is an io.Writer safe for the writer and a reader at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestUpRestartsACrashedService: modelproxy killed with SIGKILL while runs stream from
// it. `curfew up` restarts it on its address and says so; the mesh stays up; the runs,
// whose model steps were cut, carry on through the durable-state rules and succeed;
// endpoints.json names the new pid and counts the restart. No spend is lost with the
// killed decoders: each run's summary counts the cut attempt's tokens beside the
// retry's, and so does the durable ledger, from the parts the decoder appended while it
// streamed.
func TestUpRestartsACrashedService(t *testing.T) {
	t.Parallel()
	const runs = 8
	stderr := &syncBuffer{}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := t.TempDir()
	m, err := meshproc.Start(ctx, dir, meshproc.Options{Stderr: stderr})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := m.Stop(); err != nil {
			t.Errorf("curfew up did not stop cleanly: %v", err)
		}
		if t.Failed() {
			t.Logf("curfew up's stderr:\n%s", stderr.String())
		}
	})
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	// Each run streams a 3 s model step (the kill lands in it), then sleeps, then answers.
	plan := `{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 120, "tools": [{"name": "sleep", "args": {"ms": 500}}]},
	  {"answer_tokens": 4}]}`
	st0, err := store.Open(ctx, filepath.Join(dir, "curfew.db")) // curfew up's store
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st0.Close() })
	ids := make([]string, runs)
	for i := range runs {
		resp, err := oc.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan,
			IdempotencyKey: fmt.Sprintf("up-restart-%d-%d", time.Now().UnixNano(), i), Timeout: durationpb.New(90 * time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = resp.GetRun().GetRunId()
	}
	time.Sleep(1500 * time.Millisecond)
	old := m.PIDs()["modelproxy"]
	if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}

	for _, id := range ids {
		for {
			resp, err := oc.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
			if err != nil {
				t.Fatalf("GetRun %s: %v", id, err)
			}
			run := resp.GetRun()
			if st := run.GetStatus(); st != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
				if st != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
					t.Errorf("run %s ended %s: %s %s", id, st, run.GetErrorCode(), run.GetErrorMessage())
				}
				checkSpendKept(ctx, t, st0, run)
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("run %s still %s", id, run.GetStatus())
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	b, err := os.ReadFile(filepath.Join(dir, cli.EndpointsFile))
	if err != nil {
		t.Fatal(err)
	}
	var eps cli.Endpoints
	if err := json.Unmarshal(b, &eps); err != nil {
		t.Fatal(err)
	}
	now := eps.Services["modelproxy"].PID
	if eps.Restarts["modelproxy"] != 1 || now == 0 || now == old {
		t.Fatalf("endpoints.json: modelproxy pid %d (was %d), restarts %v: want a new pid and 1 restart", now, old, eps.Restarts)
	}
	if err := syscall.Kill(now, 0); err != nil {
		t.Fatalf("the restarted modelproxy (pid %d) is not running: %v", now, err)
	}
	for _, want := range []string{"curfew up: modelproxy exited unexpectedly (signal: killed); restarting it in 1s (restart 1)",
		fmt.Sprintf("curfew up: modelproxy restarted (pid %d, restart 1)", now)} {
		if !strings.Contains(stderr.String(), want) {
			t.Errorf("curfew up's stderr lacks %q:\n%s", want, stderr.String())
		}
	}
}

// checkSpendKept checks that run's think step root/m0 (120 tokens, cut by the kill
// after about 60 and decoded again in full) counts the cut attempt's tokens beside the
// retry's, in the summary and in the durable ledger: more than 120 in each.
func checkSpendKept(ctx context.Context, t *testing.T, st store.Store, run *orchestratorv1.Run) {
	t.Helper()
	var summary int64
	for _, n := range run.GetNodes() {
		if n.GetId() == "root/m0" {
			summary = n.GetTokens()
		}
	}
	var ledger int64
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) { // the last part lands within persistDelay
		u, err := st.TokenUsage(ctx, run.GetTenant(), run.GetRunId())
		if err != nil {
			t.Fatal(err)
		}
		if ledger = u.ByNode["root/m0"]; ledger > 120 || time.Now().After(end) {
			break
		}
	}
	if summary <= 120 || ledger <= 120 {
		t.Errorf("run %s: root/m0 has %d tokens in its summary and %d in the ledger; want more than the retry's 120 in each (the cut attempt's too)",
			run.GetRunId(), summary, ledger)
	}
}
