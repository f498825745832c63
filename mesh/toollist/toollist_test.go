package toollist_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/toollist"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func tenant(name string) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{Tenant: name})
}

// serve is a toolrunner fake whose ListTools answers one tool named after the tenant
// (<tenant>__tool), or fails while down is set.
func serve(t *testing.T, down *atomic.Bool) (*meshtest.Tools, toolrunnerv1.ToolRunnerServiceClient) {
	t.Helper()
	tools := meshtest.NewTools(nil)
	tools.SetList(func(ctx context.Context) (*toolrunnerv1.ListToolsResponse, error) {
		if down.Load() {
			return nil, status.Error(codes.Unavailable, "toolrunner is restarting")
		}
		return &toolrunnerv1.ListToolsResponse{Tools: []*toolrunnerv1.ToolInfo{
			{Name: md.IdentityFrom(ctx).Tenant + "__tool", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT},
		}}, nil
	})
	return tools, toolrunnerv1.NewToolRunnerServiceClient(meshtest.Serve(t, mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}, tools.Register))
}

func names(ts *toollist.Tools) string {
	var out []string
	for _, s := range ts.Specs() {
		out = append(out, s.GetName())
	}
	return strings.Join(out, ",")
}

// Each tenant's list is asked once and kept for the TTL, then asked again; Invalidate
// drops it at once.
func TestListKeptPerTenant(t *testing.T) {
	var down atomic.Bool
	fake, c := serve(t, &down)
	l := toollist.New(c, toollist.Options{TTL: 300 * time.Millisecond})
	if got := names(l.Tools(tenant("acme"))); got != "acme__tool" {
		t.Fatalf("acme told of %q", got)
	}
	if got := names(l.Tools(tenant("globex"))); got != "globex__tool" {
		t.Fatalf("globex told of %q", got)
	}
	_ = l.Tools(tenant("acme"))
	if n := fake.Lists(); n != 2 {
		t.Errorf("%d listings for two tenants within the TTL, want 2", n)
	}
	time.Sleep(400 * time.Millisecond) // past the TTL
	_ = l.Tools(tenant("acme"))
	if n := fake.Lists(); n != 3 {
		t.Errorf("%d listings, want 3: acme's list expired", n)
	}
	l.Invalidate("acme")
	_ = l.Tools(tenant("acme"))
	if n := fake.Lists(); n != 4 {
		t.Errorf("%d listings, want 4: acme's list was dropped", n)
	}
}

// A failed listing answers the built-ins and keeps nothing: the next call asks again.
// The failure is logged once for the outage, and its end once.
func TestFailureFallsBackAndLogsOnce(t *testing.T) {
	var down atomic.Bool
	down.Store(true)
	fake, c := serve(t, &down)
	var logs bytes.Buffer
	l := toollist.New(c, toollist.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	for range 3 {
		ts := l.Tools(tenant("acme"))
		if ts.Listed() || names(ts) != names(toollist.Builtins()) {
			t.Fatalf("told of %q (listed %v) while toolrunner is down, want the built-ins", names(ts), ts.Listed())
		}
	}
	if n := fake.Lists(); n != 3 {
		t.Errorf("%d listings, want 3: a failure is not kept", n)
	}
	down.Store(false)
	if ts := l.Tools(tenant("acme")); !ts.Listed() || names(ts) != "acme__tool" {
		t.Errorf("after the outage: %q", names(ts))
	}
	out := logs.String()
	if strings.Count(out, "level=WARN") != 1 || strings.Count(out, "level=INFO") != 1 || !strings.Contains(out, "code=Unavailable") {
		t.Errorf("logs, want one warning naming the code and one recovery:\n%s", out)
	}
}

// NeedsKey: built-ins by the catalogue; listed tools by their effects; unspecified or
// unlisted tools conservatively.
func TestNeedsKey(t *testing.T) {
	ts := toollist.FromResponse(&toolrunnerv1.ListToolsResponse{Tools: []*toolrunnerv1.ToolInfo{
		{Name: "a__none", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE},
		{Name: "a__idem", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT},
		{Name: "a__irr", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE},
		{Name: "a__unspecified"},
		// A listing cannot make a built-in retryable: the catalogue decides.
		{Name: plan.ToolDeploy, SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE},
	}})
	for name, want := range map[string]bool{
		"a__none": false, "a__idem": false, "a__irr": true, "a__unspecified": true, "a__unlisted": true,
		plan.ToolDeploy: true, plan.ToolSleep: false, plan.ToolNotify: false,
	} {
		if got := ts.NeedsKey(name); got != want {
			t.Errorf("NeedsKey(%s) = %v, want %v", name, got, want)
		}
		if got := toollist.Builtins().NeedsKey(name); catalog.IsBuiltin(name) && got != catalog.NeedsKey(name) || !catalog.IsBuiltin(name) && !got {
			t.Errorf("Builtins().NeedsKey(%s) = %v", name, got)
		}
	}
	// A tool without a schema is offered as taking any object.
	if p := ts.Specs()[3].GetParametersJson(); p != `{"type": "object"}` {
		t.Errorf("a tool without a schema has parameters %s", p)
	}
}

// Hedgeable: listed tools that read or are idempotent; of the built-ins, those the
// catalogue allows, never spawn_subagent (it runs model calls) nor a durable tool.
func TestHedgeable(t *testing.T) {
	ts := toollist.FromResponse(&toolrunnerv1.ListToolsResponse{Tools: []*toolrunnerv1.ToolInfo{
		{Name: "a__none", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE},
		{Name: "a__idem", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT},
		{Name: "a__irr", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE},
		{Name: "a__unspecified"},
		// A listing cannot make a built-in hedgeable: the catalogue decides.
		{Name: plan.ToolSpawnSubagent, SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE},
	}})
	for name, want := range map[string]bool{
		"a__none": true, "a__idem": true, "a__irr": false, "a__unspecified": false, "a__unlisted": false,
		plan.ToolSleep: true, plan.ToolFail: true, plan.ToolSpawnSubagent: false, plan.ToolKVPut: false,
		plan.ToolNotify: false, plan.ToolDeploy: false,
	} {
		if got := ts.Hedgeable(name); got != want {
			t.Errorf("Hedgeable(%s) = %v, want %v", name, got, want)
		}
		if got := toollist.Builtins().Hedgeable(name); got != (catalog.IsBuiltin(name) && want) {
			t.Errorf("Builtins().Hedgeable(%s) = %v", name, got)
		}
	}
	for _, b := range catalog.Builtins() {
		if b.RunsModels && b.Hedgeable() {
			t.Errorf("built-in %s runs model calls yet is hedgeable", b.Name)
		}
	}
}
