package openaiapi

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

func decode(t *testing.T, body string) *chatRequest {
	t.Helper()
	req, err := decodeRequest(strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// A request becomes a run: the last user message is the task, the ones before it the
// conversation; the other fields map to the run's input.
func TestRunRequest(t *testing.T) {
	req := decode(t, `{"model": "fast", "messages": [
		{"role": "system", "content": "be brief"},
		{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
		{"role": "assistant", "content": "hello"},
		{"role": "user", "content": "what now?"}],
		"max_tokens": 10, "max_completion_tokens": 20, "temperature": 0.5,
		"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
		"tools": [{"type": "function", "function": {"name": "sleep"}}]}`)
	req.registered = func(_ context.Context, key string) (map[string]bool, error) {
		return map[string]bool{"sleep": key == "k1"}, nil
	}
	run, err := req.runRequest(withKey(context.Background(), "k1"))
	if err != nil {
		t.Fatal(err)
	}
	if run.GetTask() != "what now?" || run.GetModel() != "fast" || run.GetMaxTokens() != 20 || run.GetTemperature() != 0.5 ||
		run.GetResponseSchemaJson() != `{"type": "object"}` || len(run.GetTools()) != 1 || run.GetTools()[0] != "sleep" {
		t.Errorf("run request: %v", run)
	}
	want := []struct {
		role    orchestratorv1.MessageRole
		content string
	}{{orchestratorv1.MessageRole_MESSAGE_ROLE_SYSTEM, "be brief"}, {orchestratorv1.MessageRole_MESSAGE_ROLE_USER, "hi there"},
		{orchestratorv1.MessageRole_MESSAGE_ROLE_ASSISTANT, "hello"}}
	if len(run.GetMessages()) != len(want) {
		t.Fatalf("messages: %v", run.GetMessages())
	}
	for i, w := range want {
		if m := run.GetMessages()[i]; m.GetRole() != w.role || m.GetContent() != w.content {
			t.Errorf("messages[%d] = %v, want %v %q", i, m, w.role, w.content)
		}
	}
}

// What curfew cannot honour is a 400 naming the field.
func TestRunRequestRejects(t *testing.T) {
	registry := func(context.Context, string) (map[string]bool, error) { return map[string]bool{"sleep": true}, nil }
	for _, c := range []struct{ body, param, msg string }{
		{`{"messages": []}`, "messages", "at least one"},
		{`{"messages": [{"role": "function", "content": "x"}, {"role": "user", "content": "q"}]}`, "messages[0].role", `"function" is not supported`},
		{`{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "custom", "function": {"name": "x"}}]}, {"role": "user", "content": "q"}]}`,
			"messages[0].tool_calls[0].type", `"custom" is not supported`},
		{`{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}`, "messages[0].content[0].type", `"image_url" is not supported`},
		{`{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}`, "messages[1].role", "last message"},
		{`{"messages": [{"role": "user"}]}`, "messages[0].content", "required"},
		{`{"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function", "function": {"name": "get_weather"}}]}`,
			"tools[0].function.name", "curfew runs its own tools; get_weather is not a registered tool"},
		{`{"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "web_search"}]}`, "tools[0]", "must be"},
		{`{"messages": [{"role": "user", "content": "q"}], "response_format": {"type": "json_object"}}`, "response_format.type", "not supported"},
		{`{"messages": [{"role": "user", "content": "q"}], "n": 2}`, "n", "only 1"},
	} {
		req := decode(t, c.body)
		req.registered = registry
		_, err := req.runRequest(context.Background())
		var br *badRequest
		if !errors.As(err, &br) || br.param != c.param || !strings.Contains(br.msg, c.msg) {
			t.Errorf("%s: %v, want a bad request of %s with %q", c.body, err, c.param, c.msg)
		}
	}
}

// A prior tool turn in OpenAI's shape (an assistant message with tool_calls and no
// content, then tool messages) becomes the run's assistant tool calls and tool messages.
func TestRunRequestPriorToolTurn(t *testing.T) {
	req := decode(t, `{"model": "fast", "messages": [
		{"role": "user", "content": "wait"},
		{"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "sleep", "arguments": "{\"ms\": 10}"}}]},
		{"role": "tool", "tool_call_id": "call_1", "content": "{\"slept_ms\": 10}"},
		{"role": "user", "content": "and now?"}]}`)
	run, err := req.runRequest(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	msgs := run.GetMessages()
	if len(msgs) != 3 {
		t.Fatalf("messages %v, want 3", msgs)
	}
	a, tm := msgs[1], msgs[2]
	if a.GetRole() != orchestratorv1.MessageRole_MESSAGE_ROLE_ASSISTANT || a.GetContent() != "" || len(a.GetToolCalls()) != 1 ||
		a.GetToolCalls()[0].GetId() != "call_1" || a.GetToolCalls()[0].GetName() != "sleep" || a.GetToolCalls()[0].GetArgumentsJson() != `{"ms": 10}` {
		t.Errorf("the assistant turn: %v", a)
	}
	if tm.GetRole() != orchestratorv1.MessageRole_MESSAGE_ROLE_TOOL || tm.GetToolCallId() != "call_1" || tm.GetContent() != `{"slept_ms": 10}` {
		t.Errorf("the tool turn: %v", tm)
	}
}

// The tools rule asks the registry for the tools of the request's key's tenant: a tool
// another key's tenant may use is refused, and the registry's error is the request's.
func TestToolsAreTheKeysTenants(t *testing.T) {
	registry := func(_ context.Context, key string) (map[string]bool, error) {
		switch key {
		case "acme-key":
			return map[string]bool{"sleep": true, "team__secret": true}, nil
		case "other-key":
			return map[string]bool{"sleep": true}, nil
		}
		return nil, status.Error(codes.Unauthenticated, "invalid API key")
	}
	body := `{"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function", "function": {"name": "team__secret"}}]}`
	req := decode(t, body)
	req.registered = registry
	if run, err := req.runRequest(withKey(context.Background(), "acme-key")); err != nil || len(run.GetTools()) != 1 {
		t.Errorf("acme's own tool: %v, %v; want it on the run", run, err)
	}
	var br *badRequest
	if _, err := req.runRequest(withKey(context.Background(), "other-key")); !errors.As(err, &br) || br.param != "tools[0].function.name" {
		t.Errorf("another tenant's tool: %v, want a bad request of tools[0].function.name", err)
	}
	if _, err := req.runRequest(withKey(context.Background(), "bad")); status.Code(err) != codes.Unauthenticated {
		t.Errorf("a bad key: %v, want the registry's UNAUTHENTICATED", err)
	}
}

// Without a bearer key a request is answered 401 in OpenAI's error shape, and never
// reaches the orchestrator (the handler has none here: a call would panic).
func TestMissingKey(t *testing.T) {
	h := New(Config{})
	for _, auth := range []string{"", "Basic abc", "Bearer ", "Bearer"} {
		for _, target := range []string{"POST /v1/chat/completions", "GET /v1/models"} {
			method, path, _ := strings.Cut(target, " ")
			r := httptest.NewRequest(method, path, strings.NewReader(`{"messages": [{"role": "user", "content": "q"}]}`))
			if auth != "" {
				r.Header.Set("Authorization", auth)
			}
			w := httptest.NewRecorder()
			h.ServeHTTP(w, r)
			var e apiError
			if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || w.Code != http.StatusUnauthorized || e.Error.Message == "" ||
				w.Header().Get(ShouldRetryHeader) != "false" {
				t.Errorf("%s with %q: %d %s", target, auth, w.Code, w.Body)
			}
		}
	}
}

// gRPC statuses map to HTTP statuses; RESOURCE_EXHAUSTED's RetryInfo is Retry-After; an
// internal error's detail stays in the log; only a keyed request may be retried.
func TestWriteStatus(t *testing.T) {
	h := New(Config{})
	shed, _ := status.New(codes.ResourceExhausted, "shed").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(1500 * time.Millisecond)})
	for _, c := range []struct {
		err     error
		keyed   bool
		code    int
		msg     string
		header  string
		value   string
		errCode string
	}{
		{status.Error(codes.InvalidArgument, "temperature: must be between 0 and 2"), false, 400, "temperature", ShouldRetryHeader, "false", "invalid_argument"},
		{status.Error(codes.Unauthenticated, "bad key"), false, 401, "bad key", ShouldRetryHeader, "false", "unauthenticated"},
		{status.Error(codes.PermissionDenied, "no"), false, 403, "no", ShouldRetryHeader, "false", "permission_denied"},
		{status.Error(codes.NotFound, "no run"), false, 404, "no run", ShouldRetryHeader, "false", "not_found"},
		{shed.Err(), false, 429, "shed", "Retry-After", "2", "resource_exhausted"},
		{status.Error(codes.DeadlineExceeded, "late"), false, 504, "late", ShouldRetryHeader, "false", "deadline_exceeded"},
		{status.Error(codes.Unavailable, "down"), true, 503, "down", ShouldRetryHeader, "", "unavailable"},
		{status.Error(codes.Internal, "secret stack"), false, 500, "internal error", ShouldRetryHeader, "false", "internal"},
		{context.DeadlineExceeded, false, 504, "", ShouldRetryHeader, "false", "deadline_exceeded"},
	} {
		rec := httptest.NewRecorder()
		h.writeStatus(&answer{ResponseWriter: rec, keyed: c.keyed}, c.err)
		var e apiError
		if err := json.Unmarshal(rec.Body.Bytes(), &e); err != nil || rec.Code != c.code || !strings.Contains(e.Error.Message, c.msg) ||
			e.Error.Code == nil || *e.Error.Code != c.errCode || rec.Header().Get(c.header) != c.value {
			t.Errorf("%v: %d %s %v, want %d with %q, %s: %q", c.err, rec.Code, rec.Body, rec.Header(), c.code, c.msg, c.header, c.value)
		}
		if strings.Contains(rec.Body.String(), "secret") {
			t.Errorf("%v: the internal detail leaked: %s", c.err, rec.Body)
		}
	}
}

// GET /v1/models answers the models of Config.Models in OpenAI's list shape, the default
// model first; a key the list refuses is 401 in OpenAI's error shape.
func TestModels(t *testing.T) {
	h := New(Config{DefaultModel: "smart", Models: func(_ context.Context, key string) ([]Model, error) {
		if key != "good" {
			return nil, status.Error(codes.Unauthenticated, "invalid API key")
		}
		return []Model{{ID: "sim"}, {ID: "fast", OwnedBy: "backup"}, {ID: "smart", OwnedBy: "primary"}}, nil
	}})
	get := func(key string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodGet, "/v1/models", nil)
		r.Header.Set("Authorization", "Bearer "+key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	w := get("good")
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			OwnedBy string `json:"owned_by"`
		} `json:"data"`
	}
	if err := json.Unmarshal(w.Body.Bytes(), &list); err != nil || w.Code != http.StatusOK || list.Object != "list" {
		t.Fatalf("GET /v1/models: %d %s", w.Code, w.Body)
	}
	var got []string
	for _, m := range list.Data {
		if m.Object != "model" {
			t.Errorf("%s: object %q, want model", m.ID, m.Object)
		}
		got = append(got, m.ID+"/"+m.OwnedBy)
	}
	if want := "smart/primary sim/curfew fast/backup"; strings.Join(got, " ") != want {
		t.Errorf("models %v, want %s", got, want)
	}
	var e apiError
	if w := get("bad"); w.Code != http.StatusUnauthorized || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Message == "" {
		t.Errorf("a bad key: %d %s, want 401 in OpenAI's error shape", w.Code, w.Body)
	}
}
