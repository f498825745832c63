package grpctool_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/internal/nodetool"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source/grpctool"
)

// The Node tests run examples/node-tool, a ToolService written in TypeScript on Connect's
// gRPC protocol, as a real process (package nodetool), and call it through the source.

func TestNodeToolServer(t *testing.T) {
	addr, events := nodetool.Start(t)
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
		ev := nodetool.Next(t, events, "cancelled", "", 10*time.Second)
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
