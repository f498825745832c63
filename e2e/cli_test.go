package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
)

// curfew runs the CLI against the shared mesh and returns stdout, stderr and the exit code.
func curfew(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(filepath.Join(mesh.Bin, "curfew"), append(args, "--data-dir", mesh.Dir)...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return out.String(), errb.String(), code
}

// `curfew run --json` prints one object per event, the run id first and the summary last;
// --cancel-after disconnects like a Ctrl-C, and the summary shows the spend frozen.
func TestCLIRunJSONAndCancel(t *testing.T) {
	t.Parallel()
	plan := filepath.Join(t.TempDir(), "plan.json")
	if err := os.WriteFile(plan, []byte(`{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 10, "tools": [{"name": "spawn_subagent", "args": {"plan": {"steps": [{"answer_tokens": 800}]}}}]},
	  {"answer_tokens": 10}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, stderr, code := curfew(t, "run", "--plan", plan, "--deadline", "12s", "--cancel-after", "1.5s", "--json")
	if code != 1 {
		t.Fatalf("exit %d, want 1 for a cancelled run; stderr %s", code, stderr)
	}
	var lines []map[string]any
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("not one JSON object per line: %q: %v", sc.Text(), err)
		}
		lines = append(lines, m)
	}
	if len(lines) < 3 {
		t.Fatalf("only %d events:\n%s", len(lines), out)
	}
	first, last := lines[0], lines[len(lines)-1]
	started, _ := first["started"].(map[string]any)
	if started == nil || started["run_id"] == "" {
		t.Fatalf("first event carries no run id: %v", first)
	}
	fin, _ := last["finished"].(map[string]any)
	if fin == nil || fin["run_id"] != started["run_id"] || fin["status"] != "RUN_STATUS_CANCELLED" || fin["cause"] != "CANCEL_CAUSE_CLIENT_DISCONNECT" {
		t.Fatalf("last event is not the cancelled summary: %v", last)
	}
	if after, _ := fin["tokens_after_cancel"].(string); after != "" && after != "0" && after != "1" {
		t.Errorf("tokens after cancel: %v", after)
	}
	id := started["run_id"].(string)

	// get, ls and cancel with --json.
	out, _, code = curfew(t, "get", id, "--json")
	var got map[string]any
	if code != 0 || json.Unmarshal([]byte(out), &got) != nil || got["run_id"] != id || got["status"] != "RUN_STATUS_CANCELLED" {
		t.Errorf("get --json: exit %d, %s", code, out)
	}
	out, _, code = curfew(t, "ls", "--json", "--limit", "500")
	if code != 0 || !strings.Contains(out, id) {
		t.Errorf("ls --json: exit %d, run %s not listed", code, id)
	}
	out, _, code = curfew(t, "cancel", id, "--json")
	if code != 0 || !strings.Contains(out, "CANCEL_CAUSE_CLIENT_DISCONNECT") {
		t.Errorf("cancel of an ended run must return it unchanged: exit %d %s", code, out)
	}
	_, stderr, code = curfew(t, "get", "no-such-run")
	if code != 1 || !strings.Contains(stderr, "NotFound") {
		t.Errorf("get of an unknown run: exit %d %q", code, stderr)
	}
	_, stderr, code = curfew(t, "run", "--deadline", "-1s", "x")
	if code != 2 || !strings.Contains(stderr, "--deadline") {
		t.Errorf("bad --deadline: exit %d %q", code, stderr)
	}
}

// A successful run exits 0 and prints its summary table.
func TestCLIRunSucceeds(t *testing.T) {
	t.Parallel()
	out, stderr, code := curfew(t, "run", "--deadline", "10s",
		`{"tokens_per_second": 500, "steps": [{"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": 50}}]}, {"answer_tokens": 5}]}`)
	if code != 0 {
		t.Fatalf("exit %d: %s %s", code, out, stderr)
	}
	for _, want := range []string{"succeeded", "root/s0.t0", "answer:"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	// Not a terminal: the answer step's text was written as it streamed, on a line of its
	// own before the summary, and no escape sequence repainted anything.
	var streamed, answer string
	for _, l := range strings.Split(out, "\n") {
		if s, ok := strings.CutPrefix(l, "root/m1: "); ok {
			streamed = s
		}
		if s, ok := strings.CutPrefix(l, "answer: "); ok {
			answer = s
		}
	}
	if streamed == "" || strings.TrimSpace(streamed) != answer || strings.Contains(out, "\x1b") {
		t.Errorf("streamed %q, answered %q: want the answer streamed, without escapes:\n%s", streamed, answer, out)
	}
}

// --events summary shows the summary alone: no node's line nor streamed text before
// it; a value it does not know is a usage error.
func TestCLIRunEvents(t *testing.T) {
	t.Parallel()
	plan := `{"tokens_per_second": 500, "steps": [{"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": 50}}]}, {"answer_tokens": 5}]}`
	out, stderr, code := curfew(t, "run", "--json", "--events", "summary", "--deadline", "10s", plan)
	if code != 0 {
		t.Fatalf("exit %d: %s %s", code, out, stderr)
	}
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 2 || !strings.Contains(lines[0], `"started"`) || !strings.Contains(lines[1], `"finished"`) {
		t.Errorf("--events summary printed %d lines, want the started event and the summary:\n%s", len(lines), out)
	}
	if _, stderr, code := curfew(t, "run", "--events", "tokens", plan); code != 2 || !strings.Contains(stderr, "--events") {
		t.Errorf("--events tokens: exit %d, %s; want a usage error naming --events", code, stderr)
	}
}

// Every service serves gRPC health and server reflection, so grpcurl and Kubernetes
// grpc probes work.
func TestHealthAndReflection(t *testing.T) {
	t.Parallel()
	want := map[string]string{
		"orchestrator": "curfew.orchestrator.v1.OrchestratorService",
		"toolrunner":   "curfew.toolrunner.v1.ToolRunnerService",
		"subagent":     "curfew.subagent.v1.SubagentService",
		"modelproxy":   "curfew.modelproxy.v1.ModelProxyService",
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for svc, name := range want {
		conn, err := mesh.Conn(svc)
		if err != nil {
			t.Fatal(err)
		}
		h, err := grpc_health_v1.NewHealthClient(conn).Check(ctx, &grpc_health_v1.HealthCheckRequest{})
		if err != nil || h.GetStatus() != grpc_health_v1.HealthCheckResponse_SERVING {
			t.Errorf("%s health: %v %v", svc, h, err)
		}
		rc, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := rc.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
			t.Fatal(err)
		}
		resp, err := rc.Recv()
		if err != nil {
			t.Fatal(err)
		}
		_ = rc.CloseSend()
		var names []string
		for _, s := range resp.GetListServicesResponse().GetService() {
			names = append(names, s.GetName())
		}
		joined := strings.Join(names, ",")
		for _, n := range []string{name, "grpc.health.v1.Health"} {
			if !strings.Contains(joined, n) {
				t.Errorf("%s reflection lists %s, missing %s", svc, joined, n)
			}
		}
	}
}

// curfew up refuses bad input clearly, and the admin port serves /metrics and /readyz.
func TestUpAndAdmin(t *testing.T) {
	t.Parallel()
	cmd := exec.Command(filepath.Join(mesh.Bin, "curfew"), "up", "--base-port", "70000", "--data-dir", t.TempDir())
	out, _ := cmd.CombinedOutput()
	if cmd.ProcessState.ExitCode() != 2 || !strings.Contains(string(out), "--base-port") {
		t.Errorf("curfew up --base-port 70000: exit %d %s", cmd.ProcessState.ExitCode(), out)
	}
	for svc, ep := range mesh.Endpoints.Services {
		for _, path := range []string{"/readyz", "/metrics"} {
			body, err := httpGet("http://" + ep.AdminAddr + path)
			if err != nil {
				t.Errorf("%s %s: %v", svc, path, err)
				continue
			}
			if path == "/metrics" && !strings.Contains(body, "go_goroutines") {
				t.Errorf("%s /metrics lacks the Go collector", svc)
			}
		}
	}
}

// `curfew trace` on a cancelled run shows the cancel instant, and every node ended within
// the bound after it (as the node's executor recorded its end); --json gives the same
// figures. The text view marks the cancel on the bars' axis.
func TestCLITraceCancelledRun(t *testing.T) {
	t.Parallel()
	plan := filepath.Join(t.TempDir(), "plan.json")
	if err := os.WriteFile(plan, []byte(`{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 10, "tools": [{"name": "sleep", "args": {"ms": 20000}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [
	      {"think_tokens": 5, "tools": [{"name": "spawn_subagent", "args": {"plan": {"steps": [{"answer_tokens": 800}]}}}]},
	      {"answer_tokens": 5}]}}}]},
	  {"answer_tokens": 10}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	out, stderr, code := curfew(t, "run", "--plan", plan, "--deadline", "15s", "--cancel-after", "1.5s", "--json")
	if code != 1 {
		t.Fatalf("exit %d, want 1 for a cancelled run; stderr %s", code, stderr)
	}
	var first struct {
		Started struct {
			RunID string `json:"run_id"`
		} `json:"started"`
	}
	if err := json.Unmarshal([]byte(strings.SplitN(out, "\n", 2)[0]), &first); err != nil || first.Started.RunID == "" {
		t.Fatalf("no run id in %q: %v", out, err)
	}
	id := first.Started.RunID

	out, stderr, code = curfew(t, "trace", id, "--json")
	if code != 0 {
		t.Fatalf("trace --json: exit %d: %s", code, stderr)
	}
	var tl struct {
		RunID             string   `json:"run_id"`
		Status            string   `json:"status"`
		CancelMS          *float64 `json:"cancel_ms"`
		DeadlineMS        *float64 `json:"deadline_ms"`
		TokensAfterCancel int64    `json:"tokens_after_cancel"`
		Nodes             []struct {
			ID                string   `json:"id"`
			StartMS           *float64 `json:"start_ms"`
			EndMS             *float64 `json:"end_ms"`
			EndAfterCancelMS  *float64 `json:"end_after_cancel_ms"`
			TokensAfterCancel int64    `json:"tokens_after_cancel"`
		} `json:"nodes"`
	}
	if err := json.Unmarshal([]byte(out), &tl); err != nil {
		t.Fatalf("trace --json is not one JSON object: %v\n%s", err, out)
	}
	if tl.RunID != id || tl.Status != "cancelled" || tl.CancelMS == nil || tl.DeadlineMS == nil {
		t.Fatalf("trace --json: %s", out)
	}
	// The client cancelled 1.5 s after it started the call; the run started a little
	// after that call did.
	if *tl.CancelMS < 1000 || *tl.CancelMS > 1500+750 || *tl.DeadlineMS < 14000 || *tl.DeadlineMS > 15000 {
		t.Errorf("cancel at %vms and deadline at %vms on the run's axis, want about 1500 and 15000", *tl.CancelMS, *tl.DeadlineMS)
	}
	// The same bound as the deadline drill: every node ended within 750 ms of the cancel.
	const boundMS = 750
	want := map[string]bool{"root": false, "root/s0.t0": false, "root/s0.t1/sub/s0.t0/sub/m0": false}
	for _, n := range tl.Nodes {
		if _, ok := want[n.ID]; ok {
			want[n.ID] = true
		}
		if n.EndMS == nil || n.EndAfterCancelMS == nil {
			t.Errorf("node %s has no end", n.ID)
			continue
		}
		if d := *n.EndAfterCancelMS; d > boundMS || math.Abs(d-(*n.EndMS-*tl.CancelMS)) > 0.01 {
			t.Errorf("node %s: end %vms, %vms after the cancel at %vms; want an end within %dms of the cancel", n.ID, *n.EndMS, d, *tl.CancelMS, boundMS)
		}
		if n.TokensAfterCancel > 1 {
			t.Errorf("node %s decoded %d tokens after the cancel", n.ID, n.TokensAfterCancel)
		}
	}
	for id, seen := range want {
		if !seen {
			t.Errorf("trace lacks node %s:\n%s", id, out)
		}
	}

	out, _, code = curfew(t, "trace", id)
	if code != 0 {
		t.Fatalf("trace: exit %d", code)
	}
	for _, want := range []string{"run " + id + "  cancelled (cause client_disconnect)", "cancel +", "AFTER_CANCEL", "sub", "m0"} {
		if !strings.Contains(out, want) {
			t.Errorf("trace output lacks %q:\n%s", want, out)
		}
	}
	// Every node's row carries the axis, and the cancel marker ('|' or ':' over a bar) sits
	// in the same column on each.
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	axis := strings.Index(lines[2], "0 .. ")
	col := -1
	for _, l := range lines[3:] {
		bar := l[min(axis, len(l)):]
		i := strings.IndexAny(bar, "|:")
		if i < 0 || (col >= 0 && i != col) {
			t.Errorf("row %q: cancel marker at %d, want one at the same column on every row (%d)", l, i, col)
		}
		col = i
	}
}

// A command's stderr carries only its own messages: the library's INFO line (the
// certificate it loads to dial the mesh) shows with --log-level info, not by default.
func TestCLILogLevel(t *testing.T) {
	t.Parallel()
	_, stderr, code := curfew(t, "ls", "--limit", "1")
	if code != 0 || strings.Contains(stderr, "INFO") {
		t.Errorf("ls: exit %d, stderr %q: want 0 and no INFO line", code, stderr)
	}
	_, stderr2, code := curfew(t, "ls", "--limit", "1", "--log-level", "info")
	if code != 0 || !strings.Contains(stderr2, "level=INFO") || !strings.Contains(stderr2, "certificates loaded") {
		t.Errorf("ls --log-level info: exit %d, stderr %q: want the certificate's INFO line", code, stderr2)
	}
}

// `curfew ls --model --since --until` lists only the runs ListRuns' filters select.
func TestCLIListFilters(t *testing.T) {
	t.Parallel()
	out, stderr, code := curfew(t, "run", `{"steps": [{"answer_tokens": 2}]}`, "--json")
	if code != 0 {
		t.Fatalf("run: exit %d, stderr %s", code, stderr)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var first, last struct {
		Started struct {
			RunID string `json:"run_id"`
		} `json:"started"`
		Finished struct{ Model string } `json:"finished"`
	}
	if json.Unmarshal([]byte(lines[0]), &first) != nil || json.Unmarshal([]byte(lines[len(lines)-1]), &last) != nil ||
		first.Started.RunID == "" || last.Finished.Model == "" {
		t.Fatalf("no run id or model in the run's events:\n%s", out)
	}
	id, model := first.Started.RunID, last.Finished.Model
	for _, c := range []struct {
		args   []string
		listed bool
	}{
		{[]string{"--model", model, "--since", "5m"}, true},
		{[]string{"--since", time.Now().Add(-time.Minute).UTC().Format(time.RFC3339), "--until", time.Now().Add(time.Minute).UTC().Format(time.RFC3339)}, true},
		{[]string{"--model", "no-such-model"}, false},
		{[]string{"--until", "1h"}, false},
		{[]string{"--since", time.Now().Add(time.Hour).UTC().Format(time.RFC3339)}, false},
	} {
		out, stderr, code := curfew(t, append([]string{"ls", "--limit", "500", "--json"}, c.args...)...)
		if code != 0 {
			t.Fatalf("ls %v: exit %d, stderr %s", c.args, code, stderr)
		}
		if strings.Contains(out, id) != c.listed {
			t.Errorf("ls %v: run %s listed %v, want %v", c.args, id, !c.listed, c.listed)
		}
	}
}
