package e2e

import (
	"context"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// A model node's text reaches Run's and WatchRun's streams as TextDelta events as the
// sim model decodes it: the root's and a subagent's, in order, each between its node's
// start and end, and none after a cancelled end.

// text returns the deltas of node on the tape so far, and their concatenation.
func (tp *tape) text(node string) ([]*meshv1.TextDelta, string) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	var ds []*meshv1.TextDelta
	var s string
	for _, m := range tp.msgs {
		if d := m.ev.GetText(); d != nil && m.ev.GetNodeId() == node {
			ds = append(ds, d)
			s += d.GetText()
		}
	}
	return ds, s
}

func TestTextDeltasReachRun(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := client(t)
	st, err := c.Run(ctx, &orchestratorv1.RunRequest{Task: `{"tokens_per_second": 400, "steps": [
	  {"think_tokens": 5, "tools": [{"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 400, "steps": [
	    {"answer_tokens": 12}]}}}]},
	  {"answer_tokens": 30}]}`})
	if err != nil {
		t.Fatal(err)
	}
	tp := record(st, splitRun)
	tp.wait(t)
	if tp.err != nil || tp.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run: %v, %v", tp.err, tp.finished)
	}
	checkOrder(t, tp, false)
	nodes := nodeMap(tp.finished)
	// The root's steps, and the subagent's: the sim model decodes a word a token, one
	// chunk each, so every token of the node is a delta (an answer from the response
	// cache comes in one).
	for _, id := range []string{"root/m0", "root/m1", "root/s0.t0/sub/m0"} {
		ds, text := tp.text(id)
		n := nodes[id]
		if n == nil || text == "" || (!n.GetCached() && int64(len(ds)) != n.GetTokens()) {
			t.Errorf("%s: %d deltas (%q), want one per token of the node: %v", id, len(ds), text, n)
		}
	}
	if _, text := tp.text("root/m1"); text != tp.finished.GetAnswer() {
		t.Errorf("the root's answer step streamed %q, the run answered %q", text, tp.finished.GetAnswer())
	}
	if t.Failed() {
		t.Logf("stream:\n%s", tp.dump())
	}
}

// A run cancelled mid-answer: the text stops at the answer node's cancelled end, on
// Run's stream and on a WatchRun that joined late; that watcher first got the text so
// far in one delta at offset 0, and then the deltas that follow it.
func TestTextDeltasStopAtCancel(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := client(t)
	st, err := c.Run(ctx, &orchestratorv1.RunRequest{Task: `{"tokens_per_second": 100, "steps": [{"answer_tokens": 5000}]}`})
	if err != nil {
		t.Fatal(err)
	}
	const answer = "root/m0"
	run := record(st, splitRun)
	waitText := func(tp *tape, n int) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if ds, _ := tp.text(answer); len(ds) >= n {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("fewer than %d deltas of %s within 20s:\n%s", n, answer, tp.dump())
			}
		}
	}
	waitText(run, 5)
	run.mu.Lock()
	id := run.id
	run.mu.Unlock()
	ws, err := c.WatchRun(ctx, &orchestratorv1.WatchRunRequest{RunId: id})
	if err != nil {
		t.Fatal(err)
	}
	watch := record(ws, splitWatch)
	waitText(watch, 3)
	if _, err := c.CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "e2e: text stops"}); err != nil {
		t.Fatal(err)
	}
	run.wait(t)
	watch.wait(t)
	if run.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
		t.Fatalf("run ended %v, want CANCELLED", run.finished.GetStatus())
	}
	t.Run("Run", func(t *testing.T) { checkOrder(t, run, false) })
	t.Run("WatchRun", func(t *testing.T) { checkOrder(t, watch, true) })

	rds, rtext := run.text(answer)
	wds, wtext := watch.text(answer)
	if first := wds[0]; first.GetOffset() != 0 || len(first.GetText()) < len("w w w w w") {
		t.Errorf("WatchRun's first delta at %d, %q: want the text so far (5 tokens or more) at offset 0", first.GetOffset(), first.GetText())
	}
	if len(wds) >= len(rds) {
		t.Errorf("WatchRun got %d deltas, Run %d: want the text so far in one", len(wds), len(rds))
	}
	// Both streams end with the node's cancelled end, and hold the same text; the node's
	// tokens are at least what was streamed (its record may count tokens decoded after
	// the last delta left).
	if wtext != rtext || rtext == "" {
		t.Errorf("WatchRun's text %q, Run's %q: want the same", wtext, rtext)
	}
	n := nodeMap(run.finished)[answer]
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetTokens() < int64(len(rds)) {
		t.Errorf("%s ended %v with %d tokens after %d deltas, want cancelled with at least as many", answer, n.GetStatus(), n.GetTokens(), len(rds))
	}
	run.mu.Lock()
	ended := false
	for _, m := range run.msgs {
		ended = ended || (m.node.GetId() == answer && m.node.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED)
	}
	run.mu.Unlock()
	if !ended {
		t.Errorf("no cancelled end of %s on Run's stream:\n%s", answer, run.dump())
	}
}
