package e2e

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
)

// The front door's tools allow-list is the key's tenant's: a tool that only acme may
// use is accepted in acme's request (and its run calls it), and refused with 400 in
// another tenant's, as a tool that is not registered.
func TestOpenAIToolsOfTheKeysTenant(t *testing.T) {
	t.Parallel()
	srv := toolserver.New(toolserver.Tool{Name: "secret", Description: "Only acme's.", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
		Handler: func(context.Context, toolserver.Call, func(done, total float64, msg string)) (json.RawMessage, error) {
			return json.RawMessage(`{"ok": true}`), nil
		}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	tools := filepath.Join(t.TempDir(), "tools.json")
	if err := os.WriteFile(tools, []byte(`{"sources": [{"name": "team", "kind": "grpc", "address": "`+lis.Addr().String()+`", "trusted": true,
	  "tools": {"secret": {"tenants": ["acme"]}}}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	m := startOwnMesh(t, "CURFEW_TOOLS_CONFIG="+tools)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// Wait until toolrunner lists the tool for acme (as the orchestrator asks), so that
	// the front door's first listing for acme holds it.
	conn, err := m.ConnAs(meshtls.Orchestrator, "toolrunner")
	if err != nil {
		t.Fatal(err)
	}
	tr := toolrunnerv1.NewToolRunnerServiceClient(conn)
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		resp, err := tr.ListTools(metadata.AppendToOutgoingContext(ctx, md.Tenant, "acme"), &toolrunnerv1.ListToolsRequest{})
		if err == nil && slices.ContainsFunc(resp.GetTools(), func(ti *toolrunnerv1.ToolInfo) bool { return ti.GetName() == "team__secret" }) {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("toolrunner did not list team__secret for acme: %v %v", resp, err)
		}
	}
	base := openAIURLOf(t, m)
	body := simPlan(`{"tokens_per_second": 500, "steps": [{"tools": [{"name": "team__secret", "args": {}}]}, {"answer_tokens": 1}]}`)
	body["tools"] = []map[string]any{{"type": "function", "function": map[string]any{"name": "team__secret"}}}

	res := openAIPostTo(ctx, t, base, tenantKeyOf(ctx, t, m, "acme", false), body)
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Errorf("acme naming its own tool: %d %s, want 200", res.StatusCode, b)
	}
	wantOpenAIError(t, openAIPostTo(ctx, t, base, tenantKeyOf(ctx, t, m, "globex", false), body), http.StatusBadRequest,
		"curfew runs its own tools; team__secret is not a registered tool")
	// A bad key with tools is 401, as without.
	wantOpenAIError(t, openAIPostTo(ctx, t, base, "cfk_bad", body), http.StatusUnauthorized, "API key")
}

// GET /v1/models lists modelproxy's aliases (from its providers file) beside sim, the
// default first, in OpenAI's list shape; a bad key is 401.
func TestOpenAIModelsListsTheAliases(t *testing.T) {
	t.Parallel()
	ups := map[string]*upstream{"primary": startUpstream(t), "backup": startUpstream(t)}
	m := startProviderMesh(t, `{"providers": [
	    {"name": "primary", "base_url": "{primary}", "models": ["big"]},
	    {"name": "backup", "base_url": "{backup}", "models": ["big", "small"]}],
	  "models": {"smart": {"chain": ["primary/big", "backup/big"]}, "fast": {"chain": ["backup/small"]}}}`, ups)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	get := func(key string) (*http.Response, []byte) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, openAIURLOf(t, m)+"/models", nil)
		req.Header.Set("Authorization", "Bearer "+key)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		return res, b
	}
	res, b := get(tenantKeyOf(ctx, t, m, "acme", false))
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	if err := json.Unmarshal(b, &list); err != nil || res.StatusCode != http.StatusOK || list.Object != "list" {
		t.Fatalf("GET /v1/models: %d %s (%v)", res.StatusCode, b, err)
	}
	var got []string
	for _, d := range list.Data {
		got = append(got, d.ID+"/"+d.OwnedBy)
	}
	// curfew up's orchestrator defaults to sim.
	if want := []string{"sim/curfew", "fast/backup", "smart/primary"}; !slices.Equal(got, want) {
		t.Errorf("GET /v1/models: %v, want %v", got, want)
	}
	if res, b := get("cfk_bad"); res.StatusCode != http.StatusUnauthorized || !strings.Contains(string(b), `"error"`) {
		t.Errorf("GET /v1/models with a bad key: %d %s, want 401 in OpenAI's error shape", res.StatusCode, b)
	}
}

// A prior tool turn in a completion's messages (an assistant message with tool_calls,
// then the tool message) reaches the model server in OpenAI's wire shape, through the
// front door, the run's input and modelproxy.
func TestOpenAIPriorToolTurnReachesTheModel(t *testing.T) {
	t.Parallel()
	ups := map[string]*upstream{"p": startUpstream(t)}
	m := startProviderMesh(t, `{"providers": [{"name": "p", "base_url": "{p}", "models": ["m"]}],
  "models": {"agent": {"chain": ["p/m"]}}}`, ups)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ups["p"].enqueue(t, `{"content": ["it", " is", " shipped"]}`)
	body := map[string]any{"model": "agent", "messages": []map[string]any{
		{"role": "user", "content": "where is order o-7?"},
		{"role": "assistant", "content": nil, "tool_calls": []map[string]any{
			{"id": "call_7", "type": "function", "function": map[string]any{"name": "sleep", "arguments": `{"ms": 1}`}}}},
		{"role": "tool", "tool_call_id": "call_7", "content": `{"slept_ms": 1}`},
		{"role": "user", "content": "so?"},
	}}
	res := openAIPostTo(ctx, t, openAIURLOf(t, m), tenantKeyOf(ctx, t, m, "acme", false), body)
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusOK || !strings.Contains(string(b), "it is shipped") {
		t.Fatalf("completion: %d %s", res.StatusCode, b)
	}
	calls := ups["p"].calls(t)
	if len(calls) != 1 {
		t.Fatalf("the model saw %d requests, want 1", len(calls))
	}
	var req struct {
		Messages []struct {
			Role       string  `json:"role"`
			Content    *string `json:"content"`
			ToolCallID string  `json:"tool_call_id"`
			ToolCalls  []struct {
				ID       string `json:"id"`
				Type     string `json:"type"`
				Function struct {
					Name      string `json:"name"`
					Arguments string `json:"arguments"`
				} `json:"function"`
			} `json:"tool_calls"`
		} `json:"messages"`
	}
	if err := json.Unmarshal(calls[0].Request.Body, &req); err != nil || len(req.Messages) < 4 {
		t.Fatalf("request %s (%v), want 4 messages", calls[0].Request.Body, err)
	}
	a, tm := req.Messages[1], req.Messages[2]
	if a.Role != "assistant" || len(a.ToolCalls) != 1 || a.ToolCalls[0].ID != "call_7" || a.ToolCalls[0].Type != "function" ||
		a.ToolCalls[0].Function.Name != "sleep" || a.ToolCalls[0].Function.Arguments != `{"ms": 1}` {
		t.Errorf("the model got the assistant turn as %s, want its tool call", calls[0].Request.Body)
	}
	if tm.Role != "tool" || tm.ToolCallID != "call_7" || tm.Content == nil || *tm.Content != `{"slept_ms": 1}` {
		t.Errorf("the model got the tool turn as %s, want the tool message of call_7", calls[0].Request.Body)
	}
}
