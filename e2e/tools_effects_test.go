package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/mcptest"
	"github.com/curfew-mesh/curfew/internal/nodetool"
)

// Registry tools through the whole mesh, over real processes: an irreversible MCP tool
// whose reply is lost after its effect, and the Node ToolService server's view of a run's
// deadline and cancel.

// effectsTools is the sources of a tools file: the test MCP server over stdio, recording
// each call to record, every tool of it irreversible whatever the server says.
func effectsTools(bin, record string) string {
	return fmt.Sprintf(`[{"name": "fx", "kind": "mcp_stdio", "command": %q, "args": ["--record", %q],
	  "side_effects": "irreversible"}]`, bin, record)
}

// oneToolPlan calls tool with args (a JSON object) and, when key is not "", the
// idempotency key.
func oneToolPlan(tool, args, key string) string {
	call := fmt.Sprintf(`{"name": %q, "args": %s`, tool, args)
	if key != "" {
		call += fmt.Sprintf(`, "idempotency_key": %q`, key)
	}
	return fastPlan(call + `}`)
}

// recordsOf reads the MCP server's records of tool.
func recordsOf(t *testing.T, path, tool string) []mcptest.Record {
	t.Helper()
	recs, err := mcptest.ReadRecords(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []mcptest.Record
	for _, r := range recs {
		if r.Tool == tool {
			out = append(out, r)
		}
	}
	return out
}

// TestToolEffectsExactlyOnceWhenTheReplyIsLost: the reply of an irreversible tool is lost
// between toolrunner and the orchestrator after the tool did its effect. With an
// idempotency key the orchestrator retries (UNAVAILABLE, same retry-id, same key) and
// toolrunner replays the stored result: one effect, two attempts, the run succeeds.
// Without a key the orchestrator may not retry an irreversible tool: one call, the run
// fails.
func TestToolEffectsExactlyOnceWhenTheReplyIsLost(t *testing.T) {
	dir := t.TempDir()
	record := filepath.Join(dir, "calls.jsonl")
	tag := strconv.FormatInt(time.Now().UnixNano(), 36)
	key, echoText := "fx-key-"+tag, "fx-echo-"+tag
	// The proxy loses the first reply that carries the key (the effect's result) and the
	// first that carries echo's text, each once: one proxy per marker, in a chain.
	// At each cut, the proxy counts the calls the server has recorded: the effect happened
	// before its reply was lost.
	calls := func(tool string) func() int {
		return func() int {
			recs, _ := mcptest.ReadRecords(record)
			n := 0
			for _, r := range recs {
				if r.Tool == tool {
					n++
				}
			}
			return n
		}
	}
	var keyProxy, echoProxy *cutProxy
	rig := newToolsRigVia(t, effectsTools(mcptestServer(t), record), func(toolrunner string) string {
		echoProxy = startCutProxy(t, toolrunner, echoText, calls("echo"))
		keyProxy = startCutProxy(t, echoProxy.addr(), key, calls("effect"))
		return keyProxy.addr()
	})
	ctx := context.Background()

	// What the orchestrator saw of its Execute calls: attempts by code, first or retry.
	type seen struct{ unavailable, retries float64 }
	saw := func() seen {
		return seen{executeAttempts(t, rig.orchProc, "Unavailable", false) + executeAttempts(t, rig.orchProc, "Unavailable", true),
			executeAttempts(t, rig.orchProc, "OK", true) + executeAttempts(t, rig.orchProc, "Unavailable", true)}
	}

	t.Run("with a key: replayed", func(t *testing.T) {
		before := saw()
		res, _ := runPlan(ctx, rig.orch, oneToolPlan("fx__effect", `{}`, key), 30*time.Second, 0, false)
		if res.err != nil {
			t.Fatalf("run: %v", res.err)
		}
		r := finishedRun(ctx, t, rig.orch, res)
		if cuts, atCut := keyProxy.cut(); cuts != 1 || atCut != 1 {
			t.Fatalf("the proxy lost %d replies, with %d effect calls recorded at the cut; want one lost after the effect", cuts, atCut)
		}
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("run %s, want SUCCEEDED\n%s", r.GetStatus(), dump(r))
		}
		// toolrunner's record: attempt 1 ran the tool and succeeded there; attempt 2, the
		// orchestrator's retry, was answered from the key.
		as := attemptsOf(nodeMap(r)["root/s0.t0"])
		if len(as) != 2 || as[0].n != 1 || as[1].n != 2 || as[0].retryID == "" || as[0].retryID != as[1].retryID ||
			as[0].status != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || as[1].status != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			t.Fatalf("fx__effect's attempts:%s\nwant 2 of one retry-id, both succeeded", fmtAttempts(as))
		}
		// The orchestrator's: the lost reply was UNAVAILABLE, and it retried once.
		if got := saw(); got.unavailable-before.unavailable != 1 || got.retries-before.retries != 1 {
			t.Fatalf("the orchestrator saw %v UNAVAILABLE and made %v retries of Execute, want 1 and 1",
				got.unavailable-before.unavailable, got.retries-before.retries)
		}
		recs := recordsOf(t, record, "effect")
		if len(recs) != 1 || recs[0].Meta.IdempotencyKey != key || recs[0].Meta.RunID != r.GetRunId() {
			t.Fatalf("the server saw %d effect calls (%+v), want exactly one, with key %s of run %s", len(recs), recs, key, r.GetRunId())
		}
	})

	t.Run("without a key: not retried", func(t *testing.T) {
		before := saw()
		res, _ := runPlan(ctx, rig.orch, oneToolPlan("fx__echo", fmt.Sprintf(`{"text": %q}`, echoText), ""), 30*time.Second, 0, false)
		r := finishedRun(ctx, t, rig.orch, res)
		if cuts, atCut := echoProxy.cut(); cuts != 1 || atCut != 1 {
			t.Fatalf("the proxy lost %d replies, with %d echo calls recorded at the cut; want one lost after the call", cuts, atCut)
		}
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED {
			t.Fatalf("run %s, want FAILED: an irreversible tool without a key is not retried\n%s", r.GetStatus(), dump(r))
		}
		if r.GetErrorCode() != "UNAVAILABLE" {
			t.Errorf("the run failed %s %q, want UNAVAILABLE (the lost reply)", r.GetErrorCode(), r.GetErrorMessage())
		}
		if as := attemptsOf(nodeMap(r)["root/s0.t0"]); len(as) != 1 {
			t.Fatalf("fx__echo's attempts:%s\nwant one", fmtAttempts(as))
		}
		if got := saw(); got.unavailable-before.unavailable != 1 || got.retries-before.retries != 0 {
			t.Fatalf("the orchestrator saw %v UNAVAILABLE and made %v retries of Execute, want 1 and none",
				got.unavailable-before.unavailable, got.retries-before.retries)
		}
		time.Sleep(500 * time.Millisecond) // a wrong retry would have reached the server by now
		if recs := recordsOf(t, record, "echo"); len(recs) != 1 {
			t.Fatalf("the server saw %d echo calls, want one: no retry without a key", len(recs))
		}
	})
}

// TestNodeToolServerThroughTheMesh: toolrunner's grpc source is the Node ToolService
// server; a plan's call reaches it with the run's deadline and ids, and CancelRun
// reaches its wait promptly.
func TestNodeToolServerThroughTheMesh(t *testing.T) {
	addr, events := nodetool.Start(t)
	rig := newToolsRig(t, fmt.Sprintf(`[{"name": "node", "kind": "grpc", "address": %q}]`, addr))
	ctx := context.Background()

	t.Run("time_left", func(t *testing.T) {
		res, _ := runPlan(ctx, rig.orch, oneToolPlan("node__time_left", `{}`, ""), 20*time.Second, 0, false)
		if res.err != nil {
			t.Fatalf("run: %v", res.err)
		}
		r := finishedRun(ctx, t, rig.orch, res)
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("run %s\n%s", r.GetStatus(), dump(r))
		}
		ev := nodetool.Next(t, events, "call", "time_left", 5*time.Second)
		if ev.RunID != r.GetRunId() || ev.NodeID != "root/s0.t0" {
			t.Errorf("the server saw run %q node %q, want %s root/s0.t0", ev.RunID, ev.NodeID, r.GetRunId())
		}
		// The deadline it got is the run's (toolrunner may keep a little back, never add),
		// and its grpc-timeout says the same time left, within 2 s on a loaded machine.
		runDL := r.GetDeadline().AsTime().UnixMilli()
		dl, err := strconv.ParseInt(ev.Deadline, 10, 64)
		if err != nil || dl > runDL+1 || dl < runDL-2000 {
			t.Errorf("the server's curfew-deadline %q, want the run's %d (at most 2 s less)", ev.Deadline, runDL)
		}
		// grpc-timeout is stamped when toolrunner sends the call and the server's clock is
		// read when its handler runs: on a loaded machine the one can be well ahead of
		// the other (CI saw 60 ms), so 1 s of margin above, 2 s below.
		left := runDL - ev.AtMS
		if ev.TimeLeftMS == nil || *ev.TimeLeftMS > left+1000 || *ev.TimeLeftMS < left-2000 || *ev.TimeLeftMS > 20000 {
			t.Errorf("the server's time left %v ms, want about %d ms (the run's deadline less its clock, 1 s margin above, 2 s below)", ev.TimeLeftMS, left)
		}
		if ev.TimeLeftMS != nil {
			t.Logf("the Node server had %d ms left of the run's 20 s", *ev.TimeLeftMS)
		}
	})

	t.Run("wait cancelled", func(t *testing.T) {
		cctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		started, err := rig.orch.StartRun(cctx, &orchestratorv1.StartRunRequest{Task: oneToolPlan("node__wait", `{"max_ms": 60000}`, ""),
			Timeout: durationpb.New(60 * time.Second)})
		if err != nil {
			t.Fatal(err)
		}
		id := started.GetRun().GetRunId()
		call := nodetool.Next(t, events, "call", "wait", 30*time.Second)
		if call.RunID != id {
			t.Fatalf("the server's wait is of run %q, want %s", call.RunID, id)
		}
		cancelledAt := time.Now()
		resp, err := rig.orch.CancelRun(cctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "e2e: mid-wait"})
		if err != nil {
			t.Fatalf("CancelRun: %v", err)
		}
		ev := nodetool.Next(t, events, "cancelled", "wait", 10*time.Second)
		lag := ev.AtMS - cancelledAt.UnixMilli()
		if ev.RunID != id || lag < -1 || lag > 3000 {
			t.Errorf("the server saw the cancel of run %q %d ms after CancelRun, want %s within 3 s", ev.RunID, lag, id)
		}
		r := summary(ctx, t, rig.orch, id)
		if resp.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED ||
			r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
			t.Errorf("CancelRun answered %s, the run ended %s (cause %s); want CANCELLED by the operator\n%s",
				resp.GetRun().GetStatus(), r.GetStatus(), r.GetCause(), dump(r))
		}
		t.Logf("the Node server saw the cancel %d ms after CancelRun (%s)", lag, ev.Reason)
	})
}
