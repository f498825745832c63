package toolrunner

import (
	"context"
	"encoding/json"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// toolSource is a Source in memory whose tools run the functions it is given.
type toolSource struct {
	tools []source.Tool
	run   func(ctx context.Context, c source.Call, progress func(*meshv1.Progress)) (source.Result, error)

	mu    sync.Mutex
	calls []source.Call
}

func (s *toolSource) List(context.Context) ([]source.Tool, error) { return s.tools, nil }
func (s *toolSource) Changed() <-chan struct{}                    { return nil }
func (s *toolSource) Close() error                                { return nil }

func (s *toolSource) Call(ctx context.Context, c source.Call, progress func(*meshv1.Progress)) (source.Result, error) {
	s.mu.Lock()
	s.calls = append(s.calls, c)
	s.mu.Unlock()
	return s.run(ctx, c, progress)
}

func (s *toolSource) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.calls)
}

// newRegistryEnv serves a toolrunner whose registry has one source, "ext", of src.
func newRegistryEnv(t *testing.T, src *toolSource, policy string) *env {
	return newRegistryEnvFor(t, src, policy, "")
}

// newRegistryEnvFor is newRegistryEnv, waiting for the listing as tenant sees it.
func newRegistryEnvFor(t *testing.T, src *toolSource, policy, tenant string) *env {
	t.Helper()
	cfg, err := registry.Parse([]byte(`{"sources": [{"name": "ext", "kind": "grpc", "address": "127.0.0.1:1"`+policy+`}]}`),
		func(string) (string, bool) { return "", false }, exec.LookPath)
	if err != nil {
		t.Fatal(err)
	}
	open := func(context.Context, registry.SourceConfig, registry.Hooks) (source.Source, error) { return src, nil }
	reg, err := registry.New(cfg, registry.Options{Openers: map[string]registry.Opener{registry.KindGRPC: open}, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = reg.Close() })
	deadline := time.Now().Add(5 * time.Second)
	for len(reg.Tools(tenant)) == len(registryBuiltins(reg)) {
		if time.Now().After(deadline) {
			t.Fatal("the source did not list")
		}
		time.Sleep(2 * time.Millisecond)
	}
	return newEnv(t, mesh.ServerConfig{}, Config{Tools: reg})
}

func registryBuiltins(reg *registry.Registry) []registry.Tool {
	var out []registry.Tool
	for _, tl := range reg.Tools("") {
		if tl.Source == registry.BuiltinSource {
			out = append(out, tl)
		}
	}
	return out
}

func TestRegistryToolRunsAsNode(t *testing.T) {
	src := &toolSource{tools: []source.Tool{{Name: "echo", InputSchema: json.RawMessage(`{"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}`)}},
		run: func(ctx context.Context, c source.Call, progress func(*meshv1.Progress)) (source.Result, error) {
			progress(&meshv1.Progress{Progress: 1, Total: 2, Message: "half"})
			return source.Result{Output: c.Args}, nil
		}}
	e := newRegistryEnv(t, src, "")
	const run, node = "r-reg", "root/s0.t0"
	ctx, cancel := context.WithTimeout(ident(run, node), 5*time.Second)
	defer cancel()
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "ext__echo", ArgsJson: `{"text":"hi"}`})
	if err != nil {
		t.Fatal(err)
	}
	evs, err := meshtest.Drain(st)
	if err != nil {
		t.Fatal(err)
	}
	var out string
	var progress []*meshv1.NodeEvent
	for _, ev := range evs {
		switch x := ev.GetEvent().(type) {
		case *toolrunnerv1.ExecuteResponse_Result:
			out = x.Result.GetOutputJson()
		case *toolrunnerv1.ExecuteResponse_NodeEvent:
			progress = append(progress, x.NodeEvent)
		}
	}
	if out != `{"text":"hi"}` {
		t.Errorf("output %q", out)
	}
	if len(progress) != 1 || progress[0].GetNodeId() != node || progress[0].GetProgress().GetMessage() != "half" ||
		evs[len(evs)-1].GetResult() == nil {
		t.Errorf("events %v, want one progress event of the node, then the result", evs)
	}
	c := src.calls[0]
	if c.Tool != "echo" || c.Meta.RunID != run || c.Meta.NodeID != node || c.Meta.Attempt != 1 || c.Meta.Deadline.IsZero() {
		t.Errorf("call %+v", c)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetName() != "ext__echo" || n.GetKind() != meshv1.NodeKind_NODE_KIND_TOOL {
		t.Errorf("node %v", n)
	}
	// Refused before anything is sent: bad arguments, unknown tools.
	r := execute(ident(run, "root/s0.t1"), t, e.tools, "ext__echo", `{"text": 5}`)
	if status.Code(r.err) != codes.InvalidArgument || !strings.Contains(r.err.Error(), "args.text") {
		t.Errorf("bad args: %v", r.err)
	}
	r = execute(ident(run, "root/s0.t2"), t, e.tools, "ext__nope", `{}`)
	if status.Code(r.err) != codes.NotFound {
		t.Errorf("unknown tool: %v", r.err)
	}
	if src.count() != 1 {
		t.Errorf("%d calls sent, want 1", src.count())
	}
}

// A tool's own failure fails the node FAILED_PRECONDITION with the tool's text.
func TestRegistryToolError(t *testing.T) {
	src := &toolSource{tools: []source.Tool{{Name: "fails"}}, run: func(context.Context, source.Call, func(*meshv1.Progress)) (source.Result, error) {
		return source.Result{IsError: true, Text: "repository not found"}, nil
	}}
	e := newRegistryEnv(t, src, `, "side_effects": "none"`)
	r := execute(ident("r-regerr", "root/s0.t0"), t, e.tools, "ext__fails", `{}`)
	if status.Code(r.err) != codes.FailedPrecondition || !strings.Contains(r.err.Error(), "tool ext__fails failed: repository not found") {
		t.Fatalf("%v, want FAILED_PRECONDITION with the tool's text", r.err)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-regerr", "root/s0.t0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || !strings.Contains(n.GetErrorMessage(), "repository not found") {
		t.Errorf("node %v", n)
	}
	if src.count() != 1 {
		t.Errorf("%d attempts, want 1: a tool's own failure is not retried", src.count())
	}
}

// A cancelled call cancels the tool and the node records the cancel.
func TestRegistryToolCancelled(t *testing.T) {
	started := make(chan struct{})
	src := &toolSource{tools: []source.Tool{{Name: "wait"}}, run: func(ctx context.Context, _ source.Call, _ func(*meshv1.Progress)) (source.Result, error) {
		close(started)
		<-ctx.Done()
		return source.Result{}, status.FromContextError(ctx.Err()).Err()
	}}
	e := newRegistryEnv(t, src, "")
	ctx, cancel := context.WithCancel(ident("r-regc", "root/s0.t0"))
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "ext__wait", ArgsJson: `{}`})
	if err != nil {
		t.Fatal(err)
	}
	<-started
	cancel()
	if r := drain(st); status.Code(r.err) != codes.Canceled {
		t.Fatalf("%v, want CANCELED", r.err)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-regc", "root/s0.t0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCancelledAt() == nil {
		t.Errorf("node %v, want CANCELLED", n)
	}
}

// A retry with the same idempotency key after a lost reply replays the stored result:
// the tool runs once.
func TestRegistryToolIdempotencyKeyReplays(t *testing.T) {
	src := &toolSource{tools: []source.Tool{{Name: "create"}}, run: func(_ context.Context, c source.Call, _ func(*meshv1.Progress)) (source.Result, error) {
		return source.Result{Output: json.RawMessage(`{"key":"` + c.Meta.IdempotencyKey + `"}`)}, nil
	}}
	e := newRegistryEnv(t, src, "")
	ctx := withKey(ident("r-regk", "root/s0.t0"), "issue-1")
	r1 := execute(ctx, t, e.tools, "ext__create", `{}`)
	r2 := execute(ctx, t, e.tools, "ext__create", `{}`)
	if r1.err != nil || r2.err != nil || r1.out != `{"key":"issue-1"}` || r2.out != r1.out {
		t.Fatalf("first %q %v, second %q %v", r1.out, r1.err, r2.out, r2.err)
	}
	if src.count() != 1 {
		t.Errorf("the tool ran %d times, want once", src.count())
	}
}

// The caller's retry after a lost reply (attempt 2, same key) gets the stored result and
// the tool does not run again; the node's attempts show the retry.
func TestRegistryToolRetryReplayIsAnAttempt(t *testing.T) {
	src := &toolSource{tools: []source.Tool{{Name: "create"}}, run: func(_ context.Context, c source.Call, _ func(*meshv1.Progress)) (source.Result, error) {
		return source.Result{Output: json.RawMessage(`{"key":"` + c.Meta.IdempotencyKey + `"}`)}, nil
	}}
	e := newRegistryEnv(t, src, "")
	const run, node = "r-regr", "root/s0.t0"
	ctx := withKey(ident(run, node), "issue-2")
	r1 := execute(withAttempt(ctx, "1"), t, e.tools, "ext__create", `{}`)
	r2 := execute(withAttempt(ctx, "2"), t, e.tools, "ext__create", `{}`)
	if r1.err != nil || r2.err != nil || r2.out != r1.out {
		t.Fatalf("attempt 1 %q %v, attempt 2 %q %v; want the result replayed", r1.out, r1.err, r2.out, r2.err)
	}
	if src.count() != 1 {
		t.Errorf("the tool ran %d times, want once", src.count())
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	ea := n.GetEarlierAttempts()
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || len(ea) != 1 || ea[0].GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Fatalf("node %v, want attempt 2 SUCCEEDED (replayed) after attempt 1 SUCCEEDED", n)
	}
	if !n.GetStartedAt().AsTime().After(ea[0].GetEndedAt().AsTime()) && !n.GetStartedAt().AsTime().Equal(ea[0].GetEndedAt().AsTime()) {
		t.Errorf("attempt 2 started %v, before attempt 1 ended %v", n.GetStartedAt().AsTime(), ea[0].GetEndedAt().AsTime())
	}
}

// A keyed tool that finished while its caller went away keeps its result: the caller's
// retry with the same key replays it (or joins the first call) instead of running the
// tool, and its effect, a second time.
func TestRegistryToolFinishedAfterCallerLeftIsKept(t *testing.T) {
	started := make(chan struct{}, 1)
	src := &toolSource{tools: []source.Tool{{Name: "create"}}, run: func(ctx context.Context, _ source.Call, _ func(*meshv1.Progress)) (source.Result, error) {
		started <- struct{}{}
		<-ctx.Done() // the effect is done; the tool answers although its caller left
		return source.Result{Output: json.RawMessage(`{"created":true}`)}, nil
	}}
	e := newRegistryEnv(t, src, "")
	ctx := withKey(ident("r-regk", "root/s0.t0"), "create-1")
	first, leave := context.WithCancel(withAttempt(ctx, "1"))
	done := make(chan result, 1)
	go func() { done <- execute(first, t, e.tools, "ext__create", `{}`) }()
	<-started
	leave()
	if r := <-done; status.Code(r.err) != codes.Canceled {
		t.Fatalf("attempt 1: %q %v, want CANCELED: its caller left", r.out, r.err)
	}
	r := execute(withAttempt(ctx, "2"), t, e.tools, "ext__create", `{}`)
	if r.err != nil || r.out != `{"created":true}` {
		t.Fatalf("attempt 2: %q %v, want the first attempt's result", r.out, r.err)
	}
	if n := src.count(); n != 1 {
		t.Errorf("the tool ran %d times, want once", n)
	}
}

// A tenant the tool is not for gets NOT_FOUND, as for a tool that does not exist.
func TestRegistryToolTenant(t *testing.T) {
	src := &toolSource{tools: []source.Tool{{Name: "t"}}, run: func(context.Context, source.Call, func(*meshv1.Progress)) (source.Result, error) {
		return source.Result{Output: json.RawMessage(`1`)}, nil
	}}
	e := newRegistryEnvFor(t, src, `, "tenants": ["acme"]`, "acme")
	if r := execute(ident("r-regt", "root/s0.t0"), t, e.tools, "ext__t", `{}`); status.Code(r.err) != codes.NotFound {
		t.Errorf("default tenant: %v, want NOT_FOUND", r.err)
	}
	ctx := metadata.AppendToOutgoingContext(ident("r-regt", "root/s0.t1"), md.Tenant, "acme")
	if r := execute(ctx, t, e.tools, "ext__t", `{}`); r.err != nil || r.out != "1" {
		t.Errorf("acme: %q %v", r.out, r.err)
	}
}

// ListTools answers each tenant with the built-ins, then the registry tools it may call,
// each with its schema and resolved side effects: a tool configured for another tenant
// is left out, as it is for a tool that does not exist.
func TestListToolsPerTenant(t *testing.T) {
	schema := `{"type": "object", "properties": {"q": {"type": "string"}}}`
	src := &toolSource{tools: []source.Tool{
		{Name: "search", Description: "Searches.", InputSchema: json.RawMessage(schema)},
		{Name: "secret"},
	}, run: func(context.Context, source.Call, func(*meshv1.Progress)) (source.Result, error) {
		return source.Result{Output: json.RawMessage(`1`)}, nil
	}}
	e := newRegistryEnvFor(t, src, `, "tools": {"search": {"side_effects": "none"}, "secret": {"tenants": ["acme"]}}`, "acme")
	list := func(tenant string) map[string]*toolrunnerv1.ToolInfo {
		t.Helper()
		ctx := context.Background()
		if tenant != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, md.Tenant, tenant)
		}
		resp, err := e.tools.ListTools(ctx, &toolrunnerv1.ListToolsRequest{})
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		out := map[string]*toolrunnerv1.ToolInfo{}
		for _, ti := range resp.GetTools() {
			names = append(names, ti.GetName())
			out[ti.GetName()] = ti
		}
		// The built-ins models are told of come first, in the catalogue's order.
		for i, s := range catalog.Specs() {
			if i >= len(names) || names[i] != s.GetName() {
				t.Fatalf("tenant %q: tools %v, want the built-ins first, in order", tenant, names)
			}
		}
		return out
	}
	def := list("")
	if def["ext__secret"] != nil {
		t.Errorf("the default tenant is told of ext__secret, a tool of acme's only")
	}
	s := def["ext__search"]
	if s.GetDescription() != "Searches." || s.GetInputSchemaJson() != schema || s.GetSideEffects() != toolv1.SideEffects_SIDE_EFFECTS_NONE {
		t.Errorf("ext__search = %v, want its description, schema and configured effects (none)", s)
	}
	if d := def[plan.ToolDeploy]; d.GetSideEffects() != toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE || d.GetInputSchemaJson() == "" {
		t.Errorf("deploy = %v, want the built-in's schema, irreversible", d)
	}
	if def[plan.ToolFail] != nil {
		t.Error("fail, which no model is told of, is listed")
	}
	acme := list("acme")
	// An untrusted source's tool without configured effects is irreversible.
	if sec := acme["ext__secret"]; sec.GetSideEffects() != toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE {
		t.Errorf("acme: ext__secret = %v, want it listed, irreversible", sec)
	}
	if len(acme) != len(def)+1 {
		t.Errorf("acme is told of %d tools, the default tenant %d: want one more", len(acme), len(def))
	}
}

// Without a registry, ListTools answers the built-ins models are told of.
func TestListToolsBuiltinsOnly(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	resp, err := e.tools.ListTools(context.Background(), &toolrunnerv1.ListToolsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	specs := catalog.Specs()
	if len(resp.GetTools()) != len(specs) {
		t.Fatalf("%d tools, want the %d built-ins", len(resp.GetTools()), len(specs))
	}
	for i, ti := range resp.GetTools() {
		if ti.GetName() != specs[i].GetName() || ti.GetInputSchemaJson() != specs[i].GetParametersJson() ||
			ti.GetSideEffects() == toolv1.SideEffects_SIDE_EFFECTS_UNSPECIFIED {
			t.Errorf("tool %d = %v, want %s with its schema and effects", i, ti, specs[i].GetName())
		}
	}
}
