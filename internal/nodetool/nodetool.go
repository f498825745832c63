package nodetool

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

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// Event is one line the server prints: "listening" first, then its tools' events with
// curfew's metadata of the call as it received it.
type Event struct {
	Event      string `json:"event"`
	Address    string `json:"address"`
	Tool       string `json:"tool"`
	RunID      string `json:"runId"`
	NodeID     string `json:"nodeId"`
	RetryID    string `json:"retryId"`
	Deadline   string `json:"deadline"`     // Unix ms, as sent
	TimeLeftMS *int64 `json:"time_left_ms"` // from grpc-timeout
	Reason     string `json:"reason"`
	AtMS       int64  `json:"at_ms"`
}

var (
	once    sync.Once
	js      string
	missing string // node is not installed: skip locally, fail under CI=true
	failed  string // the build failed: fail
)

// build returns the path of the built server (dist/server.js), building it once.
func build(t testing.TB) string {
	t.Helper()
	once.Do(func() {
		// Under CI=true scripts/node.sh installs Node.js when it is missing.
		if _, err := exec.LookPath("node"); err != nil && os.Getenv("CI") != "true" {
			missing = "node is not installed"
			return
		}
		repo, err := meshproc.Repo()
		if err != nil {
			failed = err.Error()
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", filepath.Join(repo, "scripts", "node.sh"), "node-tool") //nolint:gosec // the repository's own script
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			failed = "scripts/node.sh node-tool: " + err.Error() + "\n" + string(out)
			return
		}
		js = filepath.Join(repo, "examples", "node-tool", "dist", "server.js")
	})
	if missing != "" {
		meshproc.Missing(t, "the Node tool server: %s", missing)
	}
	if failed != "" {
		t.Fatal(failed)
	}
	return js
}

// Start runs the server on a free loopback port until the test ends, and returns its
// address and its events after "listening".
func Start(t testing.TB) (string, <-chan Event) {
	t.Helper()
	server := build(t)
	cmd := exec.Command("node", server, "--listen", "127.0.0.1:0") //nolint:noctx,gosec // the example this package builds; stopped with SIGTERM at the test's end
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	events := make(chan Event, 64)
	go func() {
		defer close(events)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var ev Event
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

// Next returns the next event named name (of tool, unless tool is empty), failing the
// test after within.
func Next(t testing.TB, events <-chan Event, name, tool string, within time.Duration) Event {
	t.Helper()
	timeout := time.After(within)
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				t.Fatalf("the Node tool server exited before %q", name)
			}
			if ev.Event == name && (tool == "" || ev.Tool == tool) {
				return ev
			}
		case <-timeout:
			t.Fatalf("no %q event of %q from the Node tool server within %v", name, tool, within)
		}
	}
}
