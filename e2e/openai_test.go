package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// openAIURL is the shared mesh's OpenAI-compatible API, which `curfew up` turns on.
func openAIURL(t *testing.T) string {
	t.Helper()
	return openAIURLOf(t, mesh)
}

// openAIURLOf is mesh m's OpenAI-compatible API.
func openAIURLOf(t *testing.T, m *meshproc.Mesh) string {
	t.Helper()
	addr := m.Endpoints.Services["orchestrator"].OpenAIAddr
	if addr == "" {
		t.Fatal("curfew up wrote no openai_addr for the orchestrator")
	}
	return "http://" + addr + "/v1"
}

// openAIPost posts body to the shared mesh's chat completions endpoint with key as the
// bearer key.
func openAIPost(ctx context.Context, t *testing.T, key string, body any, header ...string) *http.Response {
	t.Helper()
	return openAIPostTo(ctx, t, openAIURL(t), key, body, header...)
}

// openAIPostTo is openAIPost to the OpenAI-compatible API at base.
func openAIPostTo(ctx context.Context, t *testing.T, base, key string, body any, header ...string) *http.Response {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/chat/completions", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

type openAIError struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

// wantOpenAIError checks res is an error of code in OpenAI's shape whose message has
// want, with x-should-retry: false, and returns it.
func wantOpenAIError(t *testing.T, res *http.Response, code int, want string) openAIError {
	t.Helper()
	defer res.Body.Close()
	var e openAIError
	b, _ := io.ReadAll(res.Body)
	if err := json.Unmarshal(b, &e); err != nil || res.StatusCode != code || !strings.Contains(e.Error.Message, want) || e.Error.Type == "" {
		t.Errorf("got %d %s, want %d in OpenAI's error shape with %q", res.StatusCode, b, code, want)
	}
	if res.Header.Get("X-Should-Retry") != "false" {
		t.Errorf("a %d: x-should-retry %q, want false", code, res.Header.Get("X-Should-Retry"))
	}
	return e
}

func simPlan(plan string) map[string]any {
	return map[string]any{"model": "sim", "messages": []map[string]any{
		{"role": "system", "content": "You are curfew's simulator."},
		{"role": "user", "content": plan},
	}}
}

// The OpenAI-compatible API: a completion is a run of the key's tenant; requests it
// cannot honour, and bad keys, get OpenAI's error shape.
func TestOpenAICompletions(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tenant := "openai-" + uuid.NewString()[:8]
	key := tenantKey(ctx, t, tenant, false)

	res := openAIPost(ctx, t, key, simPlan(`{"tokens_per_second": 500, "steps": [{"answer_tokens": 4}]}`))
	var c struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Choices []struct {
			Message      struct{ Role, Content string } `json:"message"`
			FinishReason string                         `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			PromptTokens     int64 `json:"prompt_tokens"`
			CompletionTokens int64 `json:"completion_tokens"`
			TotalTokens      int64 `json:"total_tokens"`
		} `json:"usage"`
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if err := json.Unmarshal(b, &c); err != nil || res.StatusCode != http.StatusOK || c.Object != "chat.completion" || len(c.Choices) != 1 ||
		c.Choices[0].Message.Content == "" || c.Choices[0].Message.Role != "assistant" || c.Choices[0].FinishReason != "stop" || c.Usage.CompletionTokens < 4 {
		t.Fatalf("completion: %d %s (%v)", res.StatusCode, b, err)
	}
	run, err := newExternal(t, key).orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: c.ID})
	if err != nil || run.GetRun().GetTenant() != tenant || run.GetRun().GetAnswer() != c.Choices[0].Message.Content {
		t.Errorf("the completion's run %s: %v, %v; want the tenant's run with its answer", c.ID, run.GetRun(), err)
	}
	if u := c.Usage; u.PromptTokens != run.GetRun().GetPromptTokens() || u.PromptTokens == 0 || u.CompletionTokens != run.GetRun().GetTokens() ||
		u.TotalTokens != u.PromptTokens+u.CompletionTokens {
		t.Errorf("usage %+v, want the run's prompt_tokens %d and tokens %d", u, run.GetRun().GetPromptTokens(), run.GetRun().GetTokens())
	}

	for _, key := range []string{"", "hunter2", key[:len(key)-4] + "AAAA"} {
		wantOpenAIError(t, openAIPost(ctx, t, key, simPlan(`{"steps": [{"answer_tokens": 1}]}`)), http.StatusUnauthorized, "API key")
	}
	bad := simPlan(`{"steps": [{"answer_tokens": 1}]}`)
	bad["messages"] = []map[string]any{{"role": "function", "content": "x", "name": "f"}, {"role": "user", "content": "{}"}}
	if e := wantOpenAIError(t, openAIPost(ctx, t, key, bad), http.StatusBadRequest, "messages[0].role"); e.Error.Param == nil || *e.Error.Param != "messages[0].role" {
		t.Errorf("an unsupported role: param %v, want messages[0].role", e.Error.Param)
	}
	// A tool message must answer an earlier assistant message's call.
	bad["model"] = "fast"
	bad["messages"] = []map[string]any{{"role": "tool", "content": "x", "tool_call_id": "1"}, {"role": "user", "content": "{}"}}
	wantOpenAIError(t, openAIPost(ctx, t, key, bad), http.StatusBadRequest, `messages[0].tool_call_id: "1" names no tool call`)
	bad = simPlan(`{"steps": [{"answer_tokens": 1}]}`)
	bad["tools"] = []map[string]any{{"type": "function", "function": map[string]any{"name": "get_weather", "parameters": map[string]any{}}}}
	wantOpenAIError(t, openAIPost(ctx, t, key, bad), http.StatusBadRequest, "curfew runs its own tools; get_weather is not a registered tool")
	// A registered tool is the run's allow-list: the plan may call it.
	ok := simPlan(`{"tokens_per_second": 500, "steps": [{"tools": [{"name": "sleep", "args": {"ms": 10}}]}, {"answer_tokens": 1}]}`)
	ok["tools"] = []map[string]any{{"type": "function", "function": map[string]any{"name": "sleep"}}}
	if res := openAIPost(ctx, t, key, ok); res.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(res.Body)
		t.Errorf("a registered tool: %d %s, want 200", res.StatusCode, b)
		res.Body.Close()
	} else {
		res.Body.Close()
	}
	// The deadline reserve header reaches the run's input; a malformed one is refused.
	wantOpenAIError(t, openAIPost(ctx, t, key, simPlan(`{"steps": [{"answer_tokens": 1}]}`), "X-Curfew-Reserve", "soon"),
		http.StatusBadRequest, "reserve")
	res = openAIPost(ctx, t, key, simPlan(`{"tokens_per_second": 500, "steps": [{"answer_tokens": 1}]}`), "X-Curfew-Reserve", "0.25")
	var reserved struct{ ID string }
	b, _ = io.ReadAll(res.Body)
	res.Body.Close()
	if err := json.Unmarshal(b, &reserved); err != nil || res.StatusCode != http.StatusOK {
		t.Fatalf("with a reserve: %d %s", res.StatusCode, b)
	}
	if run, err := newExternal(t, key).orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: reserved.ID}); err != nil ||
		run.GetRun().GetInput().GetReserve() != "0.25" {
		t.Errorf("the run of a completion with X-Curfew-Reserve 0.25 has input %v, %v", run.GetRun().GetInput(), err)
	}
	bad = simPlan(`{"steps": [{"answer_tokens": 1}]}`)
	bad["temperature"] = 2.5
	wantOpenAIError(t, openAIPost(ctx, t, key, bad), http.StatusBadRequest, "temperature")
	wantOpenAIError(t, openAIPost(ctx, t, key, simPlan(`{"tokens_per_second": 50, "steps": [{"think_tokens": 100000}, {"answer_tokens": 1}]}`), "X-Curfew-Timeout", "1s"),
		http.StatusGatewayTimeout, "")

	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, openAIURL(t)+"/models", nil)
	req.Header.Set("Authorization", "Bearer "+key)
	mres, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(mres.Body)
	mres.Body.Close()
	if mres.StatusCode != http.StatusOK || !strings.Contains(string(b), `"id":"sim"`) {
		t.Errorf("GET /v1/models: %d %s, want the sim model", mres.StatusCode, b)
	}
}

// A client that leaves a completion, streamed or not, cancels its run with cause
// client_disconnect.
func TestOpenAIDisconnectCancelsRun(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	long := `{"tokens_per_second": 50, "steps": [{"think_tokens": 100000}, {"answer_tokens": 1}]}`
	for _, streamed := range []bool{false, true} {
		// A tenant per round, whose one run is the completion's.
		key := tenantKey(ctx, t, "openai-dc-"+uuid.NewString()[:8], false)
		ext := newExternal(t, key)
		rctx, rcancel := context.WithCancel(ctx)
		body := simPlan(long)
		body["stream"] = streamed
		go func() {
			time.Sleep(time.Second)
			rcancel()
		}()
		b, _ := json.Marshal(body)
		req, _ := http.NewRequestWithContext(rctx, http.MethodPost, openAIURL(t)+"/chat/completions", bytes.NewReader(b))
		req.Header.Set("Authorization", "Bearer "+key)
		res, err := http.DefaultClient.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, res.Body)
			res.Body.Close()
		}
		rcancel()
		// The tenant's one run: wait for its end.
		var got *orchestratorv1.Run
		for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			l, err := ext.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if len(l.GetRuns()) != 1 {
				t.Fatalf("streamed %v: the tenant has %d runs, want the completion's one", streamed, len(l.GetRuns()))
			}
			if got = l.GetRuns()[0]; got.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
				break
			}
		}
		if got.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || got.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
			t.Errorf("streamed %v: the run after the client left: %v cause %v, want CANCELLED, client_disconnect", streamed, got.GetStatus(), got.GetCause())
		}
	}
}

// A streamed completion arrives as chat.completion.chunks of the root model's text, then
// a usage chunk when asked, then [DONE]; the text is the run's answer.
func TestOpenAIStream(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	key := tenantKey(ctx, t, "openai-st-"+uuid.NewString()[:8], false)
	body := simPlan(`{"tokens_per_second": 200, "steps": [{"answer_tokens": 20}]}`)
	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": true}
	res := openAIPost(ctx, t, key, body)
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK || !strings.HasPrefix(res.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("streamed completion: %d %s", res.StatusCode, res.Header.Get("Content-Type"))
	}
	var text strings.Builder
	var id string
	deltas, done, usage := 0, false, int64(0)
	sc := bufio.NewScanner(res.Body)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			done = true
			break
		}
		var c struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			Choices []struct {
				Delta struct{ Content string } `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				CompletionTokens int64 `json:"completion_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(line), &c); err != nil || c.Object != "chat.completion.chunk" {
			t.Fatalf("not a chunk: %s (%v)", line, err)
		}
		id = c.ID
		if c.Usage != nil {
			usage = c.Usage.CompletionTokens
		}
		for _, ch := range c.Choices {
			if ch.Delta.Content != "" {
				deltas++
				text.WriteString(ch.Delta.Content)
			}
		}
	}
	if !done || deltas < 2 || usage < 20 {
		t.Fatalf("stream: done %v, %d deltas, usage %d; want [DONE] after several deltas and usage of at least 20 tokens", done, deltas, usage)
	}
	run, err := newExternal(t, key).orch.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
	if err != nil || run.GetRun().GetAnswer() != text.String() {
		t.Errorf("streamed text %q; the run's answer %q (%v)", text.String(), run.GetRun().GetAnswer(), err)
	}
}

// A request with an Idempotency-Key starts its run under the key: a retry within the
// disconnect grace after the client left attaches to the same run, which went on
// meanwhile, and gets its answer.
func TestOpenAIIdempotencyKey(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	key := tenantKey(ctx, t, "openai-idem-"+uuid.NewString()[:8], false)
	ext := newExternal(t, key)
	idem := "idem-" + uuid.NewString()
	body := simPlan(`{"tokens_per_second": 40, "steps": [{"think_tokens": 60}, {"answer_tokens": 8}]}`)
	b, _ := json.Marshal(body)

	// The first try leaves after half a second, as a client whose connection broke.
	rctx, rcancel := context.WithTimeout(ctx, 500*time.Millisecond)
	req, _ := http.NewRequestWithContext(rctx, http.MethodPost, openAIURL(t)+"/chat/completions", bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Idempotency-Key", idem)
	if res, err := http.DefaultClient.Do(req); err == nil {
		res.Body.Close()
		t.Fatalf("the first try answered %d before the run could end", res.StatusCode)
	}
	rcancel()
	l, err := ext.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
	if err != nil || len(l.GetRuns()) != 1 || l.GetRuns()[0].GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
		t.Fatalf("after the first try left: runs %v (%v); want its one run, still running", l.GetRuns(), err)
	}
	first := l.GetRuns()[0].GetRunId()

	res := openAIPost(ctx, t, key, body, "Idempotency-Key", idem)
	var c struct {
		ID      string `json:"id"`
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	b, _ = io.ReadAll(res.Body)
	res.Body.Close()
	if err := json.Unmarshal(b, &c); err != nil || res.StatusCode != http.StatusOK || c.ID != first || len(c.Choices) != 1 || c.Choices[0].Message.Content == "" {
		t.Fatalf("the retry: %d %s (%v); want the answer of run %s", res.StatusCode, b, err, first)
	}
	if l, err := ext.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{}); err != nil || len(l.GetRuns()) != 1 {
		t.Errorf("runs after the retry: %v (%v), want the one", l.GetRuns(), err)
	}
	// A keyed request's failure leaves retrying to the SDK: the retry would attach.
	res = openAIPost(ctx, t, key, simPlan(`{"tokens_per_second": 50, "steps": [{"think_tokens": 100000}, {"answer_tokens": 1}]}`),
		"Idempotency-Key", "idem-"+uuid.NewString(), "X-Curfew-Timeout", "1s")
	res.Body.Close()
	if res.StatusCode != http.StatusGatewayTimeout || res.Header.Get("X-Should-Retry") == "false" {
		t.Errorf("a keyed request out of time: %d, x-should-retry %q; want 504 without false", res.StatusCode, res.Header.Get("X-Should-Retry"))
	}
}

// A keyed run whose client left and did not come back within the disconnect grace (2 s,
// curfew up's default) is cancelled with cause client_disconnect, no sooner than the
// grace after the client left, and its tree stops.
func TestOpenAIKeyedRunAbandoned(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	key := tenantKey(ctx, t, "openai-gone-"+uuid.NewString()[:8], false)
	ext := newExternal(t, key)
	b, _ := json.Marshal(simPlan(`{"tokens_per_second": 50, "steps": [{"think_tokens": 100000}, {"answer_tokens": 1}]}`))
	rctx, rcancel := context.WithTimeout(ctx, 500*time.Millisecond)
	req, _ := http.NewRequestWithContext(rctx, http.MethodPost, openAIURL(t)+"/chat/completions", bytes.NewReader(b))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Idempotency-Key", "idem-"+uuid.NewString())
	if res, err := http.DefaultClient.Do(req); err == nil {
		res.Body.Close()
		t.Fatalf("the request answered %d before the run could end", res.StatusCode)
	}
	rcancel()
	left := time.Now()
	l, err := ext.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
	if err != nil || len(l.GetRuns()) != 1 {
		t.Fatalf("runs %v (%v), want the request's one", l.GetRuns(), err)
	}
	got := summary(ctx, t, ext.orch, l.GetRuns()[0].GetRunId())
	if got.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || got.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("the abandoned run: %v cause %v, want CANCELLED, client_disconnect\n%s", got.GetStatus(), got.GetCause(), dump(got))
	}
	// Load only delays the cancel: it cannot come before the grace (less a margin for
	// the client noticing its own timeout after the server did).
	if ended := got.GetEndedAt().AsTime(); ended.Before(left.Add(1500 * time.Millisecond)) {
		t.Errorf("the abandoned run ended %v after its client left, want no sooner than the 2 s grace", ended.Sub(left))
	}
	for _, n := range got.GetNodes() {
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED && n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
			t.Errorf("node %s: %v cause %v, want client_disconnect", n.GetId(), n.GetStatus(), n.GetCause())
		}
	}
	checkFrozen(t, got)
}
