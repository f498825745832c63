package agent_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/hedge"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// hedgeSeen is one Execute call as the hedged tool saw it.
type hedgeSeen struct {
	node, retryID string
	hedge         bool
	cancelled     bool
}

// A slow call of a read-only tool gets one backup after its p95: the backup runs as the
// tool node's child "hedge", with the same retry-id and curfew-hedge: 1, beside its twin
// (the server's retry-id table lets both run); the backup's answer wins and the
// primary is cancelled. An irreversible tool, however slow, gets none, and no model call
// is ever hedged: the model, as slow as the tool and with its latencies in the policy,
// sees one Generate per step.
func TestHedgedToolCall(t *testing.T) {
	for _, tc := range []struct {
		tool    string
		backups int
	}{{"team__read", 1}, {"team__send", 0}} {
		t.Run(tc.tool, func(t *testing.T) {
			var mu sync.Mutex
			var seen []hedgeSeen
			slowTool := func(ctx context.Context, _ string) (string, error) {
				in, _ := metadata.FromIncomingContext(ctx)
				s := hedgeSeen{node: md.IdentityFrom(ctx).NodeID, hedge: md.HedgeFrom(ctx)}
				if v := in.Get(md.RetryID); len(v) == 1 {
					s.retryID = v[0]
				}
				out := `{"from": "primary"}`
				if s.hedge {
					out = `{"from": "backup"}`
				} else {
					select {
					case <-ctx.Done():
						s.cancelled = true
					case <-time.After(1500 * time.Millisecond): // the slow tail
					}
				}
				mu.Lock()
				seen = append(seen, s)
				mu.Unlock()
				return out, ctx.Err()
			}
			slowModel := func(context.Context) error { time.Sleep(100 * time.Millisecond); return nil }
			model := meshtest.NewModel(
				meshtest.ModelStep{Before: slowModel, ToolCalls: []*modelproxyv1.ToolCall{call(0, tc.tool, `{}`)}},
				meshtest.ModelStep{Before: slowModel, Text: "done"})
			tools := meshtest.NewTools(map[string]meshtest.ToolFunc{tc.tool: slowTool})
			tools.SetList(func(context.Context) (*toolrunnerv1.ListToolsResponse, error) {
				return &toolrunnerv1.ListToolsResponse{Tools: []*toolrunnerv1.ToolInfo{
					{Name: "team__read", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE},
					{Name: "team__send", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE},
				}}, nil
			})
			tc2 := meshtest.Serve(t, mesh.ServerConfig{}, tools.Register)
			// The loop's connection has the retry layer (and budget) a service's has.
			conn, err := grpc.NewClient(tc2.Target(), append(mesh.DialOptions(mesh.ClientConfig{Retry: retry.Config{}}),
				grpc.WithTransportCredentials(insecure.NewCredentials()))...)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = conn.Close() }()
			policy, err := hedge.New(hedge.Config{MaxExtraLoad: 0.05, MinSamples: 20})
			if err != nil {
				t.Fatal(err)
			}
			for range 20 { // the tool's usual latency is 10 ms; the model's too
				policy.Observe(tc.tool, 10*time.Millisecond)
				policy.Observe("sim", 10*time.Millisecond)
				policy.Observe(agent.DefaultModel, 10*time.Millisecond)
			}
			mc := meshtest.Serve(t, mesh.ServerConfig{}, model.Register)
			notes := nodes.New(0)
			loop := agent.New(agent.Config{
				Model: modelproxyv1.NewModelProxyServiceClient(mc), ModelNodes: meshv1.NewNodeReportServiceClient(mc),
				Tools: toolrunnerv1.NewToolRunnerServiceClient(conn), ToolNodes: meshv1.NewNodeReportServiceClient(tc2),
				SettleTimeout: 2 * time.Second, Hedge: policy, Notes: notes,
			})
			ctx, stop := runCtx(t, 10*time.Second)
			defer stop()
			start := time.Now()
			if answer, err := loop.Run(ctx, "root", "", "task"); err != nil || answer != "done" {
				t.Fatalf("Run = %q, %v", answer, err)
			}
			elapsed := time.Since(start)
			if n := len(model.Calls()); n != 2 {
				t.Fatalf("%d Generate calls for 2 steps: a model call was hedged", n)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(seen) != 1+tc.backups {
				t.Fatalf("tool saw %d calls, want %d: %+v", len(seen), 1+tc.backups, seen)
			}
			if tc.backups == 0 {
				if seen[0].hedge || seen[0].cancelled {
					t.Fatalf("irreversible tool: %+v", seen[0])
				}
				return
			}
			// The backup answered first (recorded first), the primary after its cancel.
			b, p := seen[0], seen[1]
			if !b.hedge || p.hedge {
				t.Fatalf("calls %+v: want the backup first, marked curfew-hedge, and the primary unmarked", seen)
			}
			if b.node != p.node+"/"+agent.HedgeNode || b.retryID == "" || b.retryID != p.retryID {
				t.Fatalf("backup %+v, primary %+v: want the backup as the primary's child node, with its retry-id", b, p)
			}
			if !p.cancelled {
				t.Fatal("the primary ran on after its backup won")
			}
			noted, _ := notes.List(ctx, runID, []string{p.node}, 0)
			if len(noted) != 1 || noted[0].GetId() != p.node || noted[0].GetCause() != meshv1.CancelCause_CANCEL_CAUSE_SUPERSEDED {
				t.Fatalf("notes %v: want the primary noted cancelled with cause superseded", noted)
			}
			if elapsed > 1200*time.Millisecond {
				t.Fatalf("the run took %v: the backup did not cut the slow tail (1.5 s)", elapsed)
			}
		})
	}
}
