package grpctool_test

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source/grpctool"
)

// The Node tests run examples/node-tool, a ToolService written in TypeScript on Connect's
// gRPC protocol, as a real process, and call it through the source. scripts/node.sh
// installs its pinned dependencies and builds it (and Node.js itself under CI=true);
// without Node.js they skip locally (meshproc.Missing), and a failed build fails them.

var (
	nodeToolOnce sync.Once
	nodeToolJS   string
	nodeMissing  string // node is not installed: skip locally, fail under CI=true
	nodeToolErr  string // the build failed: fail
)

// nodeTool returns the path of the built server (dist/server.js), building it once.
func nodeTool(t *testing.T) string {
	t.Helper()
	nodeToolOnce.Do(func() {
		// Under CI=true scripts/node.sh installs Node.js when it is missing.
		if _, err := exec.LookPath("node"); err != nil && os.Getenv("CI") != "true" {
			nodeMissing = "node is not installed"
			return
		}
		repo, err := meshproc.Repo()
		if err != nil {
			nodeToolErr = err.Error()
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", filepath.Join(repo, "scripts", "node.sh"), "node-tool")
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			nodeToolErr = "scripts/node.sh node-tool: " + err.Error() + "\n" + string(out)
			return
		}
		nodeToolJS = filepath.Join(repo, "examples", "node-tool", "dist", "server.js")
	})
	if nodeMissing != "" {
		meshproc.Missing(t, "the Node tool server: %s", nodeMissing)
	}
	if nodeToolErr != "" {
		t.Fatal(nodeToolErr)
	}
	return nodeToolJS
}

// nodeEvent is one line the server prints.
type nodeEvent struct {
	Event   string `json:"event"`
	Address string `json:"address"`
	Tool    string `json:"tool"`
	RetryID string `json:"retryId"`
	Reason  string `json:"reason"`
	AtMS    int64  `json:"at_ms"`
}

// startNodeTool runs the server on a free loopback port and returns its address and its
// events after the first.
func startNodeTool(t *testing.T) (string, <-chan nodeEvent) {
	t.Helper()
	js := nodeTool(t)
	cmd := exec.Command("node", js, "--listen", "127.0.0.1:0")
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	events := make(chan nodeEvent, 64)
	go func() {
		defer close(events)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var ev nodeEvent
			if json.Unmarshal(sc.Bytes(), &ev) == nil {
				events <- ev
			}
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		for range events { // the reader ends with the process
		}
	})
	select {
	case ev := <-events:
		if ev.Event != "listening" || ev.Address == "" {
			t.Fatalf("first event %+v, want listening", ev)
		}
		return ev.Address, events
	case <-time.After(30 * time.Second):
		t.Fatal("the Node tool server did not start listening")
		return "", nil
	}
}

// next returns the next event named name, failing after within.
func next(t *testing.T, events <-chan nodeEvent, name string, within time.Duration) nodeEvent {
	t.Helper()
	timeout := time.After(within)
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				t.Fatalf("the Node tool server exited before %q", name)
			}
			if ev.Event == name {
				return ev
			}
		case <-timeout:
			t.Fatalf("no %q event from the Node tool server within %v", name, within)
		}
	}
}

func TestNodeToolServer(t *testing.T) {
	addr, events := startNodeTool(t)
	src := open(t, addr, grpctool.Options{})
	ctx := context.Background()

	tools, err := src.List(ctx)
	if err != nil || len(tools) != 2 || tools[0].Name != "time_left" || tools[1].Name != "wait" ||
		tools[0].Hints.ReadOnly == nil || !*tools[0].Hints.ReadOnly {
		t.Fatalf("List = %+v, %v; want time_left and wait, read-only", tools, err)
	}

	t.Run("time_left", func(t *testing.T) {
		const budget = 5 * time.Second
		meta := source.Meta{Deadline: time.Now().Add(budget), RunID: "run-node", NodeID: "root/s0.t2",
			RetryID: "retry-node-1", Attempt: 1, IdempotencyKey: "key-node-1"}
		res, err := src.Call(ctx, source.Call{Tool: "time_left", Meta: meta}, noProgress)
		if err != nil || res.IsError {
			t.Fatalf("time_left = %+v, %v", res, err)
		}
		var got struct {
			TimeLeftMS     *int64            `json:"time_left_ms"`
			DeadlineLeftMS *int64            `json:"deadline_left_ms"`
			Metadata       map[string]string `json:"metadata"`
		}
		if err := json.Unmarshal(res.Output, &got); err != nil {
			t.Fatal(err)
		}
		// What the server had left: at most the budget, and not much less on a loaded machine.
		for name, left := range map[string]*int64{"grpc-timeout": got.TimeLeftMS, "curfew-deadline": got.DeadlineLeftMS} {
			if left == nil || *left > budget.Milliseconds() || *left < budget.Milliseconds()-2000 {
				t.Errorf("the server's time left by %s = %v ms, want within 2 s under %v", name, left, budget)
			}
		}
		want := map[string]string{"runId": "run-node", "nodeId": "root/s0.t2", "retryId": "retry-node-1",
			"attempt": "1", "idempotencyKey": "key-node-1"}
		for k, v := range want {
			if got.Metadata[k] != v {
				t.Errorf("the server saw %s = %q, want %q (all: %v)", k, got.Metadata[k], v, got.Metadata)
			}
		}
	})

	t.Run("wait cancelled", func(t *testing.T) {
		callCtx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		meta := source.Meta{Deadline: time.Now().Add(time.Minute), RunID: "run-node", NodeID: "root/s0.t3", RetryID: "retry-node-2", Attempt: 1}
		var mu sync.Mutex
		var seen int
		var cancelledAt time.Time
		done := make(chan error, 1)
		go func() {
			_, err := src.Call(callCtx, source.Call{Tool: "wait", Meta: meta}, func(*meshv1.Progress) {
				mu.Lock()
				defer mu.Unlock()
				if seen++; seen == 3 { // three progress events, then the node is cancelled
					cancelledAt = time.Now()
					cancel()
				}
			})
			done <- err
		}()
		select {
		case err := <-done:
			mu.Lock()
			at := cancelledAt
			mu.Unlock()
			if at.IsZero() || status.Code(err) != codes.Canceled {
				t.Fatalf("wait = %v after %d progress events, want CANCELLED after 3", err, seen)
			}
			if d := time.Since(at); d > 2*time.Second {
				t.Fatalf("Call returned %v after the cancel", d)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Call did not return")
		}
		ev := next(t, events, "cancelled", 10*time.Second)
		// The server saw the reset: no sooner than the cancel (ms rounding), within 2 s.
		mu.Lock()
		lag := ev.AtMS - cancelledAt.UnixMilli()
		mu.Unlock()
		if ev.Tool != "wait" || ev.RetryID != "retry-node-2" || lag < -1 || lag > 2000 {
			t.Fatalf("cancelled event %+v, %d ms after the cancel; want wait's, within 2 s", ev, lag)
		}
		t.Logf("the Node server saw the cancel %d ms after it (%s)", lag, ev.Reason)
	})
}
