package agent_test

import (
	"bytes"
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/toollist"
)

const lookupSchema = `{"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}`

// teamList answers ListTools as toolrunner does for a registry whose team__lookup is
// acme's only: the built-ins, then the tenant's tools.
func teamList(ctx context.Context) (*toolrunnerv1.ListToolsResponse, error) {
	resp := &toolrunnerv1.ListToolsResponse{}
	for _, b := range catalog.Builtins() {
		if b.Spec != nil {
			resp.Tools = append(resp.Tools, &toolrunnerv1.ToolInfo{Name: b.Name, Description: b.Spec.GetDescription(),
				InputSchemaJson: b.Spec.GetParametersJson(), SideEffects: toollist.Proto(b.SideEffects)})
		}
	}
	if md.IdentityFrom(ctx).Tenant == "acme" {
		resp.Tools = append(resp.Tools, &toolrunnerv1.ToolInfo{Name: "team__lookup", Description: "Looks an order up.",
			InputSchemaJson: lookupSchema, SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE})
	}
	return resp, nil
}

func specNames(specs []*modelproxyv1.ToolSpec) []string {
	var out []string
	for _, s := range specs {
		out = append(out, s.GetName())
	}
	return out
}

// Every model step is told of the tools toolrunner lists for the run's tenant, the
// team's with their schema; the list is asked once for both steps (kept for the TTL).
// Another tenant is not told of acme's tool.
func TestModelToldOfListedTools(t *testing.T) {
	steps := []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "team__lookup", `{"id": "7"}`)}},
		{Text: "found"},
	}
	r := newRig(t, agent.Config{}, steps, map[string]meshtest.ToolFunc{
		"team__lookup": func(context.Context, string) (string, error) { return `{"order": 7}`, nil },
	})
	r.tools.SetList(teamList)
	ctx, stop := runCtx(t, 5*time.Second) // tenant acme
	defer stop()
	if answer, err := r.loop.Run(ctx, "root", "", "task"); err != nil || answer != "found" {
		t.Fatalf("Run = %q, %v", answer, err)
	}
	calls := r.model.Calls()
	want := append(specNames(catalog.Specs()), "team__lookup")
	for i, c := range calls {
		if !slices.Equal(c.Tools, want) {
			t.Errorf("model step %d was told of %v, want %v", i, c.Tools, want)
		}
		if s := c.Specs[len(c.Specs)-1]; s.GetParametersJson() != lookupSchema || s.GetDescription() != "Looks an order up." {
			t.Errorf("model step %d: team__lookup spec %v, want its listed schema and description", i, s)
		}
	}
	if n := r.tools.Lists(); n != 1 {
		t.Errorf("%d ListTools calls for two steps of one tenant, want 1 (the list is kept)", n)
	}

	other := md.WithIdentity(context.Background(), md.Identity{Tenant: "globex", RunID: "run-2", NodeID: "root"})
	other, stop2 := context.WithTimeout(other, 5*time.Second)
	defer stop2()
	_, _ = r.loop.Run(other, "root", "", "task") // its team__lookup call fails: not the point
	c := r.model.Calls()[len(calls)]
	if !slices.Equal(c.Tools, specNames(catalog.Specs())) {
		t.Errorf("tenant globex was told of %v, want the built-ins only", c.Tools)
	}
}

// When toolrunner does not list (an older toolrunner: UNIMPLEMENTED; or nothing
// listening), the model is told of the built-ins and the run goes on; the failure is
// logged once, not once per step.
func TestToolListFallback(t *testing.T) {
	steps := []meshtest.ModelStep{
		{Text: "hmm", FinishReason: "tool_calls"},
		{Text: "hmm", FinishReason: "tool_calls"},
		{Text: "done"},
	}
	for _, tc := range []struct {
		name string
		down bool
	}{{"unimplemented", false}, {"down", true}} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRig(t, agent.Config{}, steps, nil)
			var logs bytes.Buffer
			var client toollist.Client = toolrunnerv1.NewToolRunnerServiceClient(closedConn(t))
			if !tc.down {
				client = toolrunnerv1.NewToolRunnerServiceClient(meshtest.Serve(t, mesh.ServerConfig{}, r.tools.Register))
			}
			lister := toollist.New(client, toollist.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			loop := r.loopWith(t, lister)
			ctx, stop := runCtx(t, 5*time.Second)
			defer stop()
			if answer, err := loop.Run(ctx, "root", "", "task"); err != nil || answer != "done" {
				t.Fatalf("Run = %q, %v; want the answer", answer, err)
			}
			for i, c := range r.model.Calls() {
				if !slices.Equal(c.Tools, specNames(catalog.Specs())) {
					t.Errorf("step %d told of %v, want the built-ins", i, c.Tools)
				}
			}
			if n := strings.Count(logs.String(), "level=WARN"); n != 1 {
				t.Errorf("%d warnings for three steps, want 1:\n%s", n, logs.String())
			}
		})
	}
}

// loopWith is a loop on r's services whose tools are listed by lister.
func (r *rig) loopWith(t *testing.T, lister *toollist.Lister) *agent.Loop {
	t.Helper()
	return agent.New(agent.Config{Model: r.loopModel(t), Tools: toolrunnerv1.NewToolRunnerServiceClient(meshtest.Serve(t, mesh.ServerConfig{}, r.tools.Register)),
		ToolList: lister, SettleTimeout: 2 * time.Second})
}

func (r *rig) loopModel(t *testing.T) modelproxyv1.ModelProxyServiceClient {
	return modelproxyv1.NewModelProxyServiceClient(meshtest.Serve(t, mesh.ServerConfig{}, r.model.Register))
}

// closedConn is a connection to an address nothing listens on.
func closedConn(t *testing.T) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("127.0.0.1:1", append(mesh.DialOptions(mesh.ClientConfig{Retry: retry.Config{Default: retry.Policy{Disabled: true}}}),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// A tool call that failed UNAVAILABLE is retried by the loop's client as the tool's
// listed side effects allow: a none tool freely, an irreversible one, one of
// unspecified effects, or one not listed only with an idempotency key.
func TestRetryByListedSideEffects(t *testing.T) {
	list := func(context.Context) (*toolrunnerv1.ListToolsResponse, error) {
		return &toolrunnerv1.ListToolsResponse{Tools: []*toolrunnerv1.ToolInfo{
			{Name: "team__read", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE},
			{Name: "team__put", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT},
			{Name: "team__send", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE},
			{Name: "team__what"}, // unspecified
		}}, nil
	}
	for _, tc := range []struct {
		tool, key string
		attempts  int
	}{
		{"team__read", "", 2},
		{"team__put", "", 2},
		{"team__send", "", 1},
		{"team__send", "k-1", 2},
		{"team__what", "", 1},
		{"team__unlisted", "", 1},
	} {
		t.Run(tc.tool+"/"+tc.key, func(t *testing.T) {
			var attempts atomic.Int32
			flaky := func(context.Context, string) (string, error) {
				if attempts.Add(1) == 1 {
					return "", status.Error(codes.Unavailable, "blip")
				}
				return `{"ok": true}`, nil
			}
			c := call(0, tc.tool, `{}`)
			c.IdempotencyKey = tc.key
			model := meshtest.NewModel(meshtest.ModelStep{ToolCalls: []*modelproxyv1.ToolCall{c}}, meshtest.ModelStep{Text: "done"})
			tools := meshtest.NewTools(map[string]meshtest.ToolFunc{tc.tool: flaky})
			tools.SetList(list)
			tc2 := meshtest.Serve(t, mesh.ServerConfig{}, tools.Register)
			// The loop's connection retries, as a service's does (meshtest's does not).
			retrying, err := grpc.NewClient(tc2.Target(), append(mesh.DialOptions(mesh.ClientConfig{Retry: retry.Config{
				Default: retry.Policy{MaxAttempts: 3, Base: time.Millisecond, Cap: 5 * time.Millisecond}}}),
				grpc.WithTransportCredentials(insecure.NewCredentials()))...)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = retrying.Close() }()
			loop := agent.New(agent.Config{
				Model:     modelproxyv1.NewModelProxyServiceClient(meshtest.Serve(t, mesh.ServerConfig{}, model.Register)),
				Tools:     toolrunnerv1.NewToolRunnerServiceClient(retrying),
				ToolNodes: meshv1.NewNodeReportServiceClient(tc2), SettleTimeout: 2 * time.Second,
			})
			ctx, stop := runCtx(t, 5*time.Second)
			defer stop()
			answer, err := loop.Run(ctx, "root", "", "task")
			if got := int(attempts.Load()); got != tc.attempts {
				t.Errorf("%d attempts, want %d", got, tc.attempts)
			}
			if tc.attempts == 2 && (err != nil || answer != "done") {
				t.Errorf("Run = %q, %v; want the answer after the retry", answer, err)
			}
			if tc.attempts == 1 && status.Code(err) != codes.Unavailable {
				t.Errorf("Run = %q, %v; want the tool's UNAVAILABLE, not retried", answer, err)
			}
		})
	}
}
