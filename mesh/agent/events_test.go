package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

func progressEvent(node string, p float64) *meshv1.NodeEvent {
	return &meshv1.NodeEvent{NodeId: node, Kind: &meshv1.NodeEvent_Progress{Progress: &meshv1.Progress{Progress: p, Total: 100}}}
}

// The node events a tool streams reach EmitEvent in order, between the tool node's start
// and end; one naming a node outside the tool's subtree is dropped.
func TestToolEventsReachEmitEvent(t *testing.T) {
	report := func(ctx context.Context, _ string) (string, error) {
		for _, ev := range []*meshv1.NodeEvent{
			progressEvent("", 10),                     // the tool's own node
			progressEvent("root/s0.t0/sub/s0.t0", 20), // a node beneath it
			progressEvent("root/s0.t1", 30),           // its sibling's: not its to report
			progressEvent("root/s0.t0x", 40),          // a prefix, not beneath it
			progressEvent("", 50),
		} {
			if err := meshtest.SendEvent(ctx, ev); err != nil {
				return "", err
			}
		}
		return `{}`, nil
	}
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "report", `{}`)}},
		{Text: "done"},
	}, map[string]meshtest.ToolFunc{"report": report})
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	if _, err := r.loop.Run(ctx, "root", "", "task"); err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	var got []string
	for _, l := range r.order {
		if strings.Contains(l, "/s0.t") {
			got = append(got, l)
		}
	}
	r.mu.Unlock()
	want := []string{
		"node root/s0.t0 RUNNING",
		"event root/s0.t0 10",
		"event root/s0.t0/sub/s0.t0 20",
		"event root/s0.t0 50",
		"node root/s0.t0 SUCCEEDED",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("emitted:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// A tool call that failed UNAVAILABLE is retried by the client chain, before any message
// and after it reported progress too (its callee died mid-call: the loop's tool calls
// are retry.Restartable). The fake answers to sleep's name: a built-in without side
// effects, which callers retry without a key (a name that is not a built-in's they
// retry only with one).
func TestToolRetriedAfterItsEvents(t *testing.T) {
	flaky := func(withEvent bool) meshtest.ToolFunc {
		var mu sync.Mutex
		attempts := 0
		return func(ctx context.Context, _ string) (string, error) {
			mu.Lock()
			attempts++
			first := attempts == 1
			mu.Unlock()
			if !first {
				return `{"ok":true}`, nil
			}
			if withEvent {
				if err := meshtest.SendEvent(ctx, progressEvent("", 1)); err != nil {
					return "", err
				}
			}
			return "", status.Error(codes.Unavailable, "flaky")
		}
	}
	for _, tc := range []struct {
		name      string
		withEvent bool
		wantCalls int
		wantCode  codes.Code
	}{
		{"quiet", false, 2, codes.OK},
		{"reported", true, 2, codes.OK},
	} {
		t.Run(tc.name, func(t *testing.T) {
			model := meshtest.NewModel(
				meshtest.ModelStep{ToolCalls: []*modelproxyv1.ToolCall{call(0, plan.ToolSleep, `{}`)}},
				meshtest.ModelStep{Text: "done"})
			tools := meshtest.NewTools(map[string]meshtest.ToolFunc{plan.ToolSleep: flaky(tc.withEvent)})
			mc := meshtest.Serve(t, mesh.ServerConfig{}, model.Register)
			// The fake tools, reached with curfew's default retry policy.
			plain := meshtest.Serve(t, mesh.ServerConfig{}, tools.Register)
			tc2, err := grpc.NewClient(plain.Target(), append(mesh.DialOptions(mesh.ClientConfig{}),
				grpc.WithTransportCredentials(insecure.NewCredentials()))...)
			if err != nil {
				t.Fatal(err)
			}
			defer tc2.Close()
			loop := agent.New(agent.Config{Model: modelproxyv1.NewModelProxyServiceClient(mc),
				Tools: toolrunnerv1.NewToolRunnerServiceClient(tc2), SettleTimeout: time.Second})
			ctx, cancelRun := runCtx(t, 5*time.Second)
			defer cancelRun()
			_, err = loop.Run(ctx, "root", "", "task")
			if status.Code(err) != tc.wantCode {
				t.Fatalf("run: %v, want %v", err, tc.wantCode)
			}
			if n := len(tools.Calls()); n != tc.wantCalls {
				t.Fatalf("%d tool calls, want %d", n, tc.wantCalls)
			}
		})
	}
}

// Every model node's text reaches EmitEvent as it streams, one TextDelta per chunk of
// text, in order between the node's start and end, each at the byte offset where it
// follows: the answer node's deltas concatenate to the answer. The last chunk of a step
// that asks for tools carries no text and sends none.
func TestModelTextReachesEmitEvent(t *testing.T) {
	const think, answer = "let me see", "the answer is ünïcode 42"
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{Text: think, ToolCalls: []*modelproxyv1.ToolCall{call(0, "noop", `{}`)}},
		{Text: answer},
	}, map[string]meshtest.ToolFunc{"noop": func(context.Context, string) (string, error) { return `{}`, nil }})
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	got, err := r.loop.Run(ctx, "root", "", "task")
	if err != nil {
		t.Fatal(err)
	}
	if got != answer {
		t.Fatalf("answer %q, want %q", got, answer)
	}
	r.mu.Lock()
	order := slices.Clone(r.order)
	r.mu.Unlock()
	for _, tc := range []struct{ node, text string }{{"root/m0", think}, {"root/m1", answer}} {
		var lines []string
		for _, l := range order {
			// Token progress updates of the node come between: only its start counts here.
			if l == "node "+tc.node+" RUNNING" && len(lines) > 0 {
				continue
			}
			if strings.HasPrefix(l, "node "+tc.node+" ") || strings.HasPrefix(l, "text "+tc.node+" ") {
				lines = append(lines, l)
			}
		}
		var want []string
		want = append(want, "node "+tc.node+" RUNNING")
		off := 0
		for i, w := range strings.Fields(tc.text) {
			if i > 0 {
				w = " " + w
			}
			want = append(want, fmt.Sprintf("text %s %d %q", tc.node, off, w))
			off += len(w)
		}
		want = append(want, "node "+tc.node+" SUCCEEDED")
		if !slices.Equal(lines, want) {
			t.Fatalf("%s emitted:\n%s\nwant:\n%s", tc.node, strings.Join(lines, "\n"), strings.Join(want, "\n"))
		}
	}
}

// A model step whose decoder dies mid-stream (UNAVAILABLE after some text) is started
// over: the step's text is the new attempt's (its deltas start again at offset 0), the
// answer is whole, and the node's tokens count both attempts, as both were spent.
func TestModelStepRestartedAfterCut(t *testing.T) {
	const answer = "the whole answer"
	var cuts atomic.Int32
	model := meshtest.NewModel(meshtest.ModelStep{
		Text: answer,
		After: func(context.Context) error {
			if cuts.Add(1) == 1 {
				return status.Error(codes.Unavailable, "error reading from server: EOF")
			}
			return nil
		},
	})
	plain := meshtest.Serve(t, mesh.ServerConfig{}, model.Register)
	// The fake model, reached with curfew's default retry policy.
	mc, err := grpc.NewClient(plain.Target(), append(mesh.DialOptions(mesh.ClientConfig{}),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	defer mc.Close()
	var (
		mu      sync.Mutex
		offsets []int64
		last    *meshv1.Node
	)
	loop := agent.New(agent.Config{Model: modelproxyv1.NewModelProxyServiceClient(mc),
		Tools: toolrunnerv1.NewToolRunnerServiceClient(plain), SettleTimeout: time.Second,
		Emit: func(n *meshv1.Node) {
			mu.Lock()
			defer mu.Unlock()
			if n.GetId() == "root/m0" {
				last = n
			}
		},
		EmitEvent: func(ev *meshv1.NodeEvent) {
			mu.Lock()
			defer mu.Unlock()
			if d := ev.GetText(); d != nil && ev.GetNodeId() == "root/m0" {
				offsets = append(offsets, d.GetOffset())
			}
		}})
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	got, err := loop.Run(ctx, "root", "", "task")
	if err != nil {
		t.Fatal(err)
	}
	if got != answer {
		t.Fatalf("answer %q, want %q", got, answer)
	}
	if n := len(model.Calls()); n != 2 {
		t.Fatalf("%d model calls, want 2 (one cut, one restarted)", n)
	}
	mu.Lock()
	defer mu.Unlock()
	if last.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || last.GetTokens() != 6 {
		t.Fatalf("node %v: want SUCCEEDED with 6 tokens (3 per attempt)", last)
	}
	if want := []int64{0, 3, 9, 0, 3, 9}; !slices.Equal(offsets, want) {
		t.Fatalf("text offsets %v, want %v: the restarted attempt streams from 0", offsets, want)
	}
}
