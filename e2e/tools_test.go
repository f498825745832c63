package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/mcptest"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// Tool sources end to end (docs/tools.md): plans call MCP servers' tools as
// source__tool through the real orchestrator, toolrunner and MCP server processes.

// toolPlan is a plan of one step calling the tools (JSON objects), then an answer.
func toolPlan(tools ...string) string {
	return `{"tokens_per_second": 1000, "steps": [
	  {"think_tokens": 2, "tools": [` + strings.Join(tools, ",") + `]},
	  {"answer_tokens": 2}]}`
}

// firstTool is the node of the first tool call of toolPlan.
const firstTool = "root/s0.t0"

// textOf returns the texts of an MCP tool output (its content blocks as JSON).
func textOf(t *testing.T, output string) []string {
	t.Helper()
	var blocks []struct {
		Type, Text string
	}
	if err := json.Unmarshal([]byte(output), &blocks); err != nil {
		t.Fatalf("tool output %s is not MCP content blocks: %v", output, err)
	}
	var out []string
	for _, b := range blocks {
		out = append(out, b.Text)
	}
	return out
}

// server-everything's echo, over stdio and over streamable HTTP, in one step: both
// outputs are the run's tool results.
func TestToolsEverythingEcho(t *testing.T) {
	node, entry := everything(t)
	url := startEverythingHTTP(t)
	cfg, _ := json.Marshal([]map[string]any{
		{"name": "everything", "kind": "mcp_stdio", "command": node, "args": []string{entry, "stdio"}},
		{"name": "everything-http", "kind": "mcp_http", "url": url},
	})
	r := newToolsRig(t, string(cfg))
	r.waitSource("everything")
	r.waitSource("everything-http")

	tag := fmt.Sprintf("curfew-%d", time.Now().UnixNano())
	res, _ := runPlan(t.Context(), r.orch, toolPlan(
		`{"name": "everything__echo", "args": {"message": "stdio `+tag+`"}}`,
		`{"name": "everything-http__echo", "args": {"message": "http `+tag+`"}}`), 20*time.Second, 0, false)
	if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run: %v\n%s", res.err, dump(res.finished))
	}
	nodes := nodeMap(res.finished)
	for id, name := range map[string]string{"root/s0.t0": "everything__echo", "root/s0.t1": "everything-http__echo"} {
		if n := nodes[id]; n.GetName() != name || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			t.Errorf("node %s: %s %s, want %s SUCCEEDED", id, n.GetName(), n.GetStatus(), name)
		}
	}
	outs := r.toolOutputs(res.started.GetRunId())
	if len(outs) != 2 {
		t.Fatalf("the journal holds %d tool outputs %q, want 2", len(outs), outs)
	}
	for i, want := range []string{"Echo: stdio " + tag, "Echo: http " + tag} {
		if got := textOf(t, outs[i]); !slices.Equal(got, []string{want}) {
			t.Errorf("tool %d output %q, want the text %q", i, got, want)
		}
	}
}

// server-everything's long-running operation reports progress and ignores a cancel. Its
// run's client disconnects mid-progress: the tool's node ends with cause
// client_disconnect, a watcher sees no progress of it after its end, and the operation's
// later reports reach toolrunner only to be counted late.
func TestToolsEverythingClientDisconnect(t *testing.T) {
	node, entry := everything(t)
	cfg, _ := json.Marshal([]map[string]any{
		{"name": "everything", "kind": "mcp_stdio", "command": node, "args": []string{entry, "stdio"}},
	})
	r := newToolsRig(t, string(cfg))
	r.waitSource("everything")
	late := map[string]string{"source": "everything"}
	if n := r.metric("curfew_tool_late_messages_total", late); n != 0 {
		t.Fatalf("%v late messages before any call", n)
	}

	// 100 steps of 150 ms: 15 s, longer than the test waits for it.
	ctx, disconnect := context.WithCancel(t.Context())
	defer disconnect()
	st, err := r.orch.Run(ctx, &orchestratorv1.RunRequest{Task: toolPlan(
		`{"name": "everything__trigger-long-running-operation", "args": {"duration": 15, "steps": 100}}`)})
	if err != nil {
		t.Fatal(err)
	}
	run := record(st, splitRun)
	run.waitEvents(t, 1, firstTool)
	run.mu.Lock()
	id := run.id
	run.mu.Unlock()
	ws, err := r.orch.WatchRun(t.Context(), &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	watch := record(ws, splitWatch)
	watch.waitEvents(t, 2, firstTool)
	run.waitEvents(t, 3, firstTool)

	disconnect()
	disconnected := time.Now()
	watch.wait(t)
	sum := summary(t.Context(), t, r.orch, id)
	tool := nodeMap(sum)[firstTool]
	if sum.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || sum.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT ||
		tool.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || tool.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("want the run and its tool cancelled by client_disconnect:\n%s", dump(sum))
	}
	if took := tool.GetEndedAt().AsTime().Sub(disconnected); took > 5*time.Second {
		t.Errorf("the tool's node ended %v after the disconnect, want within 5s", took)
	}
	checkOrder(t, watch, true) // no progress of the node after its end, nor of the run's
	run.wait(t)
	if code(run.err) != "Canceled" {
		t.Errorf("the disconnected Run call ended %v, want Canceled", run.err)
	}
	checkOrder(t, run, false) // up to the disconnect
	for _, ev := range append(run.events(firstTool), watch.events(firstTool)...) {
		if ev.GetProgress().GetTotal() != 100 {
			t.Errorf("event %v, want the operation's total of 100 steps", ev)
		}
	}
	ended := false
	watch.mu.Lock()
	for _, m := range watch.msgs {
		ended = ended || (m.node != nil && m.node.GetId() == firstTool && m.node.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED)
	}
	watch.mu.Unlock()
	if !ended {
		t.Errorf("WatchRun did not see %s end:\n%s", firstTool, watch.dump())
	}

	// The operation goes on reporting every 150 ms: toolrunner drops and counts them.
	deadline := time.Now().Add(10 * time.Second)
	for r.metric("curfew_tool_late_messages_total", late) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("curfew_tool_late_messages_total{source=\"everything\"} still 0 10s after the disconnect")
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("node ended %v after the disconnect; %d events watched; late messages counted %v after %v",
		tool.GetEndedAt().AsTime().Sub(disconnected).Round(time.Millisecond), len(watch.events(firstTool)),
		r.metric("curfew_tool_late_messages_total", late), time.Since(disconnected).Round(time.Millisecond))
}

// curfew-mcptest records the _meta of each call: the deadline it is told is the run's,
// to the millisecond, and the run and node are the run's and the tool's. A stubborn
// tool that ignores the cancel does not hold its run: CancelRun ends it promptly.
func TestToolsMCPTestMetaAndStubbornCancel(t *testing.T) {
	recFile := filepath.Join(t.TempDir(), "record.jsonl")
	cfg, _ := json.Marshal([]map[string]any{
		{"name": "mcptest", "kind": "mcp_stdio", "command": mcptestBin(t), "args": []string{"--record", recFile}},
	})
	r := newToolsRig(t, string(cfg))
	r.waitSource("mcptest")

	res, _ := runPlan(t.Context(), r.orch, toolPlan(`{"name": "mcptest__wait", "args": {"ms": 50}}`), 20*time.Second, 0, false)
	if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run: %v\n%s", res.err, dump(res.finished))
	}
	recs, err := mcptest.ReadRecords(recFile)
	if err != nil || len(recs) != 1 || recs[0].Tool != "wait" {
		t.Fatalf("records %+v (%v), want the one wait call", recs, err)
	}
	rec := recs[0]
	// curfew-deadline carries the run's deadline in whole milliseconds (truncated), the
	// toolrunner's context takes it, and the source sends its Unix milliseconds: the
	// same instant as RunStarted's, truncated to the millisecond.
	runDeadline := res.started.GetDeadline().AsTime()
	if rec.MetaError != "" || rec.Meta.Deadline != runDeadline.UnixMilli() {
		t.Errorf("the server was told deadline %d (%s), want the run's %d (%s)", rec.Meta.Deadline, rec.MetaError, runDeadline.UnixMilli(), fmtTime(runDeadline))
	}
	if left := time.Duration(rec.Meta.TimeoutMS) * time.Millisecond; left <= 0 || left > 20*time.Second {
		t.Errorf("timeout_ms %d, want the time left of a 20s run", rec.Meta.TimeoutMS)
	}
	if rec.Meta.RunID != res.started.GetRunId() || rec.Meta.NodeID != firstTool || rec.Meta.RetryID == "" {
		t.Errorf("the server was told run %q node %q retry %q, want run %q node %s and a retry id",
			rec.Meta.RunID, rec.Meta.NodeID, rec.Meta.RetryID, res.started.GetRunId(), firstTool)
	}
	if n := nodeMap(res.finished)[firstTool]; n.GetRetryId() != rec.Meta.RetryID {
		t.Errorf("the node's retry id %q, the server's %q", n.GetRetryId(), rec.Meta.RetryID)
	}

	// stubborn reports every 100 ms for 20 s whatever happens.
	st, err := r.orch.Run(t.Context(), &orchestratorv1.RunRequest{Task: toolPlan(`{"name": "mcptest__stubborn", "args": {"ms": 20000, "progress_ms": 100}}`)})
	if err != nil {
		t.Fatal(err)
	}
	run := record(st, splitRun)
	run.waitEvents(t, 2, firstTool)
	run.mu.Lock()
	id := run.id
	run.mu.Unlock()
	cancelled := time.Now()
	if _, err := r.orch.CancelRun(t.Context(), &orchestratorv1.CancelRunRequest{RunId: id, Reason: "e2e: stubborn tool"}); err != nil {
		t.Fatal(err)
	}
	run.wait(t)
	took := time.Since(cancelled)
	if run.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
		t.Fatalf("run ended %v (%v), want CANCELLED:\n%s", run.finished.GetStatus(), run.err, dump(run.finished))
	}
	if tool := nodeMap(run.finished)[firstTool]; tool.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || tool.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Errorf("tool node: %s %s, want CANCELLED by operator:\n%s", tool.GetStatus(), tool.GetCause(), dump(run.finished))
	}
	// The tool would hold it for 20 s; a run waits for no tool that ignores the cancel.
	if took > 3*time.Second {
		t.Errorf("the run ended %v after CancelRun, want within 3s", took)
	}
	checkOrder(t, run, false)
	t.Logf("deadline %d ms told, run's %s; the stubborn run ended %v after CancelRun", rec.Meta.Deadline, runDeadline.Format(time.RFC3339Nano), took.Round(time.Millisecond))
}

// A stdio server killed (SIGKILL) in the middle of a call: the call fails UNAVAILABLE,
// naming the source and how its process ended, and so does the run; toolrunner starts
// the server again, and the next run's call succeeds.
func TestToolsMCPTestServerKilled(t *testing.T) {
	cfg, _ := json.Marshal([]map[string]any{
		{"name": "mcptest", "kind": "mcp_stdio", "command": mcptestBin(t)},
	})
	r := newToolsRig(t, string(cfg))
	r.waitSource("mcptest")
	kids := children(t, r.tools.PID())
	if len(kids) != 1 {
		t.Fatalf("toolrunner has children %v, want the one MCP server", kids)
	}
	server := kids[0]

	st, err := r.orch.Run(t.Context(), &orchestratorv1.RunRequest{Task: toolPlan(`{"name": "mcptest__wait", "args": {"ms": 20000, "progress_ms": 100}}`)})
	if err != nil {
		t.Fatal(err)
	}
	run := record(st, splitRun)
	run.waitEvents(t, 2, firstTool)
	logged := r.logLines()
	if err := exec.Command("kill", "-9", fmt.Sprint(server)).Run(); err != nil { //nolint:noctx // kill returns at once
		t.Fatal(err)
	}
	killed := time.Now()
	run.wait(t)
	sum := run.finished
	if sum.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED || sum.GetErrorCode() != "UNAVAILABLE" ||
		!strings.Contains(sum.GetErrorMessage(), `mcp source "mcptest"`) || !strings.Contains(sum.GetErrorMessage(), "killed") {
		t.Fatalf("run: %v; want FAILED UNAVAILABLE naming the source and the kill:\n%s", run.err, dump(sum))
	}
	if tool := nodeMap(sum)[firstTool]; tool.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || tool.GetErrorCode() != "UNAVAILABLE" {
		t.Errorf("tool node %s %s, want FAILED UNAVAILABLE:\n%s", tool.GetStatus(), tool.GetErrorCode(), dump(sum))
	}
	if took := time.Since(killed); took > 5*time.Second {
		t.Errorf("the run ended %v after the kill, want within 5s", took)
	}

	t.Logf("the run failed %v after the kill: %s %s", time.Since(killed).Round(time.Millisecond), sum.GetErrorCode(), sum.GetErrorMessage())
	// toolrunner restarts the server (a new process) and its session.
	r.waitLog(logged, 15*time.Second, "mcp source reconnected", func(m map[string]any) bool {
		return m["msg"] == "mcp source reconnected" && m["source"] == "mcptest"
	})
	if kids := children(t, r.tools.PID()); len(kids) != 1 || kids[0] == server {
		t.Fatalf("toolrunner's children after the restart %v, want one new server (the killed one was %d)", kids, server)
	}
	res, _ := runPlan(t.Context(), r.orch, toolPlan(`{"name": "mcptest__echo", "args": {"text": "after the kill"}}`), 20*time.Second, 0, false)
	if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("the run after the restart: %v\n%s", res.err, dump(res.finished))
	}
	if outs := r.toolOutputs(res.started.GetRunId()); len(outs) != 1 || !slices.Equal(textOf(t, outs[0]), []string{"after the kill"}) {
		t.Errorf("tool outputs %q, want the echo of \"after the kill\"", outs)
	}
}

// A tools file that breaks a rule stops toolrunner at start, exit code 2, naming the
// field; a source nothing answers does not: toolrunner serves, a call of its tools fails
// UNAVAILABLE naming it, and the built-in tools work.
func TestToolsConfigErrors(t *testing.T) {
	bin, err := meshproc.Build()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, c := range []struct {
		name, file, want string
	}{
		{"inline header", `{"sources": [{"name": "search", "kind": "mcp_http", "url": "http://127.0.0.1:1/mcp", "headers": {"Authorization": "Bearer x"}}]}`,
			`tools.json: sources[0].headers["Authorization"]: inline values are not allowed`},
		{"field of another kind", `{"sources": [{"name": "gh", "kind": "mcp_stdio", "command": "true"}, {"name": "fs", "kind": "mcp_stdio", "command": "true", "url": "http://x/"}]}`,
			`tools.json: sources[1].url: not used by kind "mcp_stdio"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(dir, "tools.json")
			if err := os.WriteFile(path, []byte(c.file), 0o600); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, filepath.Join(bin, "toolrunner"), "--insecure", "--addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--tools-config", path)
			out, err := cmd.CombinedOutput()
			if cmd.ProcessState == nil || cmd.ProcessState.ExitCode() != 2 || !strings.Contains(string(out), c.want) {
				t.Errorf("toolrunner: %v, output:\n%s\nwant exit 2 and %q", err, out, c.want)
			}
		})
	}

	nowhere := fmt.Sprintf("http://127.0.0.1:%d/mcp", freePort(t))
	cfg, _ := json.Marshal([]map[string]any{{"name": "nowhere", "kind": "mcp_http", "url": nowhere}})
	r := newToolsRig(t, string(cfg)) // it waits for toolrunner's health to be SERVING
	r.waitLog(0, 20*time.Second, "tool source down for nowhere", func(m map[string]any) bool {
		return m["msg"] == "tool source down" && m["source"] == "nowhere"
	})
	res, _ := runPlan(t.Context(), r.orch, toolPlan(`{"name": "nowhere__echo", "args": {"text": "x"}}`), 20*time.Second, 0, false)
	if s := res.finished; s.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED || s.GetErrorCode() != "UNAVAILABLE" ||
		!strings.Contains(s.GetErrorMessage(), "tool nowhere__echo: source nowhere is down") {
		t.Errorf("run: %v; want FAILED UNAVAILABLE \"tool nowhere__echo: source nowhere is down\":\n%s", res.err, dump(s))
	}
	res, _ = runPlan(t.Context(), r.orch, toolPlan(`{"name": "sleep", "args": {"ms": 20}}`), 20*time.Second, 0, false)
	if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Errorf("a built-in plan: %v\n%s", res.err, dump(res.finished))
	}
	conn, err := r.c.Conn(r.tools)
	if err != nil {
		t.Fatal(err)
	}
	if h, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true)); err != nil || h.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("toolrunner health %v (%v), want SERVING", h.GetStatus(), err)
	}
}
