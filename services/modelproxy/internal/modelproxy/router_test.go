package modelproxy

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/openaitest"
)

// providerEnv is a modelproxy with a providers file whose providers are openaitest
// servers (real HTTP, the OpenAI streaming format) reached through the real OpenAI client.
type providerEnv struct {
	*env
	reg *prometheus.Registry
	up  map[string]*openaitest.Server
}

// newProviderEnv starts one openaitest server per name in servers and a modelproxy whose
// providers file is fileJSON with every {name} replaced by that server's URL.
func newProviderEnv(t testing.TB, fileJSON string, servers ...string) *providerEnv {
	t.Helper()
	pe := &providerEnv{reg: prometheus.NewRegistry(), up: map[string]*openaitest.Server{}}
	for _, name := range servers {
		s := openaitest.New(t)
		pe.up[name] = s
		fileJSON = strings.ReplaceAll(fileJSON, "{"+name+"}", s.URL())
	}
	f, err := ParseFile([]byte(fileJSON))
	if err != nil {
		t.Fatalf("providers file: %v", err)
	}
	r, err := NewRouter(f, RouterOptions{Registry: pe.reg, Log: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	srv := newServer(t)
	srv.Router = r
	cc := meshtest.Serve(t, mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, srv)
		meshv1.RegisterNodeReportServiceServer(gs, srv.Report())
	})
	pe.env = &env{srv: srv, model: modelproxyv1.NewModelProxyServiceClient(cc), report: meshv1.NewNodeReportServiceClient(cc)}
	return pe
}

func userMsg(s string) []*modelproxyv1.Message {
	return []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: s}}
}

// text joins the deltas of a call's chunks.
func text(chunks []*modelproxyv1.GenerateResponse) string {
	var b strings.Builder
	for _, c := range chunks {
		b.WriteString(c.GetDelta())
	}
	return b.String()
}

func last(chunks []*modelproxyv1.GenerateResponse) *modelproxyv1.GenerateResponse {
	if len(chunks) == 0 {
		return nil
	}
	return chunks[len(chunks)-1]
}

const oneProvider = `{"providers": [{"name": "p", "base_url": "{p}", "models": ["m"]}],
  "models": {"fast": {"chain": ["p/m"]}}}`

// A completion streams through the OpenAI provider: text and tool calls reach the caller,
// the tools are sent upstream, the ledger counts the tokens as they arrive, and the node
// names the provider.
func TestProviderStreamsCompletionWithTools(t *testing.T) {
	pe := newProviderEnv(t, oneProvider, "p")
	pe.up["p"].Enqueue(openaitest.Reply{Content: openaitest.Tokens(12),
		ToolCalls: []openaitest.ToolCall{{ID: "c1", Name: "sleep", Arguments: `{"ms": 5}`, Fragments: 3}}, FinishReason: "tool_calls"})
	req := &modelproxyv1.GenerateRequest{Model: "fast", Messages: userMsg("wait a bit"), MaxTokens: 64,
		Tools: []*modelproxyv1.ToolSpec{{Name: "sleep", Description: "wait", ParametersJson: `{"type": "object"}`}}}
	chunks, err := generate(ident("r1", "root/m0"), t, pe.model, req)
	if err != nil {
		t.Fatal(err)
	}
	fin := last(chunks)
	if fin.GetProvider() != "p" || fin.GetServedModel() != "m" || fin.GetCached() || fin.GetFinishReason() != "tool_calls" {
		t.Fatalf("final chunk = %v", fin)
	}
	if tc := fin.GetToolCalls(); len(tc) != 1 || tc[0].GetName() != "sleep" || tc[0].GetArgsJson() != `{"ms": 5}` || tc[0].GetId() != "c1" {
		t.Fatalf("tool calls = %v", tc)
	}
	if got := text(chunks); got != strings.Join(openaitest.Tokens(12), "") {
		t.Fatalf("text %q", got)
	}
	reqs := pe.up["p"].Requests()
	if len(reqs) != 1 || !strings.Contains(string(reqs[0].Body), `"sleep"`) || !strings.Contains(string(reqs[0].Body), `"include_usage":true`) {
		t.Fatalf("upstream requests: %d, first %s", len(reqs), reqs[0].Body)
	}
	n := meshtest.WaitNode(t, pe.srv.Nodes, "r1", "root/m0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetProvider() != "p" || n.GetServedModel() != "m" || len(n.GetFallbacks()) != 0 {
		t.Fatalf("node = %v", n)
	}
	total, _, _ := pe.srv.Ledger.Figures("r1", "root/m0", time.Time{})
	if want := fin.GetUsage().GetCompletionTokens(); total != want || total < 12 {
		t.Fatalf("ledger %d tokens, usage says %d", total, want)
	}
}

const twoProviders = `{"providers": [
    {"name": "primary", "base_url": "{primary}", "models": ["big"]},
    {"name": "backup", "base_url": "{backup}", "models": ["big", "small"]}],
  "models": {"smart": {"chain": ["primary/big", "backup/big"], "degrade_to": "backup/small"}},
  "breaker": {"failures": 3, "open_timeout": "400ms", "jitter": 0.01}}`

// With the primary returning 503, calls fall back to the backup; after three failures the
// primary's breaker opens and calls go straight to the backup without a request to the
// primary; after the open timeout one probe goes to the recovered primary and closes it.
func TestFallbackBreakerOpensAndProbeCloses(t *testing.T) {
	pe := newProviderEnv(t, twoProviders, "primary", "backup")
	var mu sync.Mutex
	primaryUp := false
	pe.up["primary"].Handle(func(openaitest.Request) openaitest.Reply {
		mu.Lock()
		defer mu.Unlock()
		if primaryUp {
			return openaitest.Reply{Content: openaitest.Words("primary answers")}
		}
		return openaitest.Reply{Status: 503, Error: ptr(openaitest.ErrorFor(503))}
	})
	pe.up["backup"].Handle(func(openaitest.Request) openaitest.Reply {
		return openaitest.Reply{Content: openaitest.Words("backup answers")}
	})
	call := func(i int) (*modelproxyv1.GenerateResponse, *meshv1.Node) {
		t.Helper()
		node := fmt.Sprintf("root/m%d", i)
		chunks, err := generate(ident("rf", node), t, pe.model, &modelproxyv1.GenerateRequest{Model: "smart", Messages: userMsg("hi")})
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		return last(chunks), meshtest.WaitNode(t, pe.srv.Nodes, "rf", node)
	}
	for i := range 3 {
		fin, n := call(i)
		if fin.GetProvider() != "backup" || len(n.GetFallbacks()) != 1 || n.GetFallbacks()[0].GetReason() != ReasonUnavailable ||
			n.GetFallbacks()[0].GetProvider() != "primary" {
			t.Fatalf("call %d: answered by %q, node %v", i, fin.GetProvider(), n)
		}
	}
	if got := pe.up["primary"].Count(); got != 3 {
		t.Fatalf("primary saw %d requests, want 3", got)
	}
	if st := pe.srv.Router.Breaker("primary").State(); st != breaker.StateOpen {
		t.Fatalf("primary breaker %v after 3 failures", st)
	}
	for i := 3; i < 8; i++ {
		fin, n := call(i)
		if fin.GetProvider() != "backup" || n.GetFallbacks()[0].GetReason() != ReasonBreakerOpen {
			t.Fatalf("call %d with the breaker open: answered by %q, node %v", i, fin.GetProvider(), n)
		}
	}
	if got := pe.up["primary"].Count(); got != 3 {
		t.Fatalf("primary saw %d requests while its breaker was open, want still 3", got)
	}

	mu.Lock()
	primaryUp = true
	mu.Unlock()
	deadline := time.Now().Add(10 * time.Second)
	for i := 8; ; i++ {
		fin, _ := call(i)
		if fin.GetProvider() == "primary" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the primary's breaker never let a probe through")
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got := pe.up["primary"].Count(); got != 4 {
		t.Fatalf("primary saw %d requests, want 3 failures and 1 probe", got)
	}
	if st := pe.srv.Router.Breaker("primary").State(); st != breaker.StateClosed {
		t.Fatalf("primary breaker %v after a successful probe", st)
	}
	fin, n := call(1000)
	if fin.GetProvider() != "primary" || len(n.GetFallbacks()) != 0 {
		t.Fatalf("after recovery: answered by %q, node %v", fin.GetProvider(), n)
	}
	if v := testutil.ToFloat64(pe.srv.Router.m.fallbacks.WithLabelValues("smart", "primary", ReasonBreakerOpen)); v < 5 {
		t.Fatalf("curfew_model_fallbacks_total breaker_open = %v, want at least 5", v)
	}
}

// A schema-bound call whose answer is not valid JSON for the schema degrades to the named
// model; the node records the invalid answer, and the failure is counted.
func TestDegradeOnInvalidOutput(t *testing.T) {
	pe := newProviderEnv(t, twoProviders, "primary", "backup")
	pe.up["primary"].Enqueue(openaitest.Reply{Content: openaitest.Words(`{"answer": 42`)}) // truncated JSON
	pe.up["backup"].Enqueue(openaitest.Reply{Content: openaitest.Words(`{"answer": "forty-two"}`)})
	req := &modelproxyv1.GenerateRequest{Model: "smart", Messages: userMsg("answer in JSON"),
		ResponseSchema: &modelproxyv1.ResponseSchema{Name: "answer", SchemaJson: `{"type": "object", "required": ["answer"], "properties": {"answer": {"type": "string"}}}`}}
	chunks, err := generate(ident("rd", "root/m0"), t, pe.model, req)
	if err != nil {
		t.Fatal(err)
	}
	if fin := last(chunks); fin.GetProvider() != "backup" || fin.GetServedModel() != "small" || text(chunks) != `{"answer": "forty-two"}` {
		t.Fatalf("answer %q from %v", text(chunks), fin)
	}
	n := meshtest.WaitNode(t, pe.srv.Nodes, "rd", "root/m0")
	if fb := n.GetFallbacks(); len(fb) != 1 || fb[0].GetReason() != ReasonInvalidOutput || fb[0].GetProvider() != "primary" || n.GetServedModel() != "small" {
		t.Fatalf("node = %v", n)
	}
	if got := pe.up["backup"].Requests(); len(got) != 1 || got[0].Chat.Model != "small" {
		t.Fatalf("degrade requests: %+v", got)
	}
	if v := testutil.ToFloat64(pe.srv.Router.m.validationFailures.WithLabelValues("smart", "primary")); v != 1 {
		t.Fatalf("validation failures = %v", v)
	}

	// Without a degrade policy the failure reaches the caller: nothing is masked.
	pe2 := newProviderEnv(t, oneProvider, "p")
	pe2.up["p"].Enqueue(openaitest.Reply{Content: openaitest.Words(`not json`)})
	req.Model = "fast"
	_, err = generate(ident("rd2", "root/m0"), t, pe2.model, req)
	meshtest.WantCode(t, err, codes.FailedPrecondition, "response schema")
}

// A retried identical deterministic prompt is answered from the cache: the upstream sees
// one request and the ledger no new tokens.
func TestCacheAnswersRetriedDeterministicPrompt(t *testing.T) {
	pe := newProviderEnv(t, oneProvider, "p")
	pe.up["p"].Handle(func(openaitest.Request) openaitest.Reply {
		return openaitest.Reply{Content: openaitest.Tokens(9)}
	})
	req := &modelproxyv1.GenerateRequest{Model: "fast", Messages: userMsg("same prompt"), Temperature: proto.Float64(0)}
	first, err := generate(ident("rc", "root/m0"), t, pe.model, req)
	if err != nil {
		t.Fatal(err)
	}
	second, err := generate(ident("rc", "root/m1"), t, pe.model, req)
	if err != nil {
		t.Fatal(err)
	}
	if got := pe.up["p"].Count(); got != 1 {
		t.Fatalf("upstream saw %d requests, want 1", got)
	}
	if text(second) != text(first) || !last(second).GetCached() || last(second).GetUsage().GetCompletionTokens() != 0 {
		t.Fatalf("second answer %q, final %v", text(second), last(second))
	}
	if n, _, _ := pe.srv.Ledger.Figures("rc", "root/m1", time.Time{}); n != 0 {
		t.Fatalf("ledger shows %d tokens for the cached answer", n)
	}
	if n := meshtest.WaitNode(t, pe.srv.Nodes, "rc", "root/m1"); !n.GetCached() || n.GetProvider() != "p" {
		t.Fatalf("node = %v", n)
	}
	if v := testutil.ToFloat64(pe.srv.Router.m.tokensSaved); v < 9 {
		t.Fatalf("tokens saved = %v", v)
	}
	// Not deterministic, not marked: never cached.
	req2 := &modelproxyv1.GenerateRequest{Model: "fast", Messages: userMsg("other prompt")}
	for i := range 2 {
		if _, err := generate(ident("rc", fmt.Sprintf("root/n%d", i)), t, pe.model, req2); err != nil {
			t.Fatal(err)
		}
	}
	if got := pe.up["p"].Count(); got != 3 {
		t.Fatalf("upstream saw %d requests, want 3", got)
	}
}

// Cancellations and client errors never trip a provider's breaker.
func TestCancelledCallsNeverTripTheBreaker(t *testing.T) {
	pe := newProviderEnv(t, twoProviders, "primary", "backup")
	var n int
	var mu sync.Mutex
	pe.up["primary"].Handle(func(openaitest.Request) openaitest.Reply {
		mu.Lock()
		defer mu.Unlock()
		n++
		if n%2 == 0 {
			return openaitest.Reply{Status: 400, Error: ptr(openaitest.ErrorFor(400))}
		}
		return openaitest.Reply{Content: openaitest.Tokens(1000), Interval: 5 * time.Millisecond}
	})
	for i := range 20 {
		ctx, cancel := context.WithCancel(ident("rx", fmt.Sprintf("root/m%d", i)))
		st, err := pe.model.Generate(ctx, &modelproxyv1.GenerateRequest{Model: "smart", Messages: userMsg("long")})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil { // the first token (or the 400)
			meshtest.WantCode(t, err, codes.InvalidArgument)
		}
		cancel()
	}
	if st := pe.srv.Router.Breaker("primary").State(); st != breaker.StateClosed {
		t.Fatalf("primary breaker %v after cancelled calls and client errors", st)
	}
	if got := pe.up["backup"].Count(); got != 0 {
		t.Fatalf("backup saw %d requests: a cancel or a client error fell back", got)
	}
	// Every cancelled stream was closed upstream: no chunk after the client went.
	for i := range pe.up["primary"].Count() {
		wctx, stop := context.WithTimeout(context.Background(), 5*time.Second)
		c, err := pe.up["primary"].Wait(wctx, i)
		stop()
		if err != nil {
			t.Fatalf("upstream call %d never ended: %v", i, err)
		}
		if c.ChunksAfterGone > 0 {
			t.Fatalf("call %d: %d chunks after the client went", c.N, c.ChunksAfterGone)
		}
	}
}

// A call whose time left cannot cover the provider's expected latency is refused with
// DEADLINE_EXCEEDED before any upstream request.
func TestShedBeforeUpstream(t *testing.T) {
	pe := newProviderEnv(t, `{"providers": [{"name": "p", "base_url": "{p}", "models": ["m"],
	  "expected_ttft": "2s", "expected_tokens_per_second": 10}], "models": {"slow": {"chain": ["p/m"]}}}`, "p")
	ctx, cancel := context.WithTimeout(ident("rs", "root/m0"), 1500*time.Millisecond)
	defer cancel()
	_, err := generate(ctx, t, pe.model, &modelproxyv1.GenerateRequest{Model: "slow", Messages: userMsg("x"), MaxTokens: 5})
	meshtest.WantCode(t, err, codes.DeadlineExceeded, "expected")
	if got := pe.up["p"].Count(); got != 0 {
		t.Fatalf("upstream saw %d requests", got)
	}
	if v := testutil.ToFloat64(pe.srv.Router.m.sheds.WithLabelValues("slow")); v != 1 {
		t.Fatalf("sheds = %v", v)
	}
}

// Once part of an answer reached the caller, a failing stream is not answered again by
// another provider: the caller gets the error.
func TestNoFallbackAfterPartialAnswer(t *testing.T) {
	pe := newProviderEnv(t, twoProviders, "primary", "backup")
	pe.up["primary"].Enqueue(openaitest.Reply{Content: openaitest.Tokens(5), Reset: true})
	_, err := generate(ident("rp", "root/m0"), t, pe.model, &modelproxyv1.GenerateRequest{Model: "smart", Messages: userMsg("x")})
	meshtest.WantCode(t, err, codes.Unavailable)
	if got := pe.up["backup"].Count(); got != 0 {
		t.Fatalf("backup saw %d requests after a partial answer", got)
	}
}

// Unknown models are NOT_FOUND with the configured names.
func TestUnknownModel(t *testing.T) {
	pe := newProviderEnv(t, oneProvider, "p")
	_, err := generate(ident("ru", "root/m0"), t, pe.model, &modelproxyv1.GenerateRequest{Model: "nope", Messages: userMsg("x")})
	meshtest.WantCode(t, err, codes.NotFound, "fast", "p/m", "sim")
}

func ptr[T any](v T) *T { return &v }

// The providers file is validated at start, with errors naming the field.
func TestParseFileErrors(t *testing.T) {
	for _, tc := range []struct{ file, want string }{
		{`{"providers": [{"name": "P!", "base_url": "http://x/v1", "models": ["m"]}]}`, "providers[0].name"},
		{`{"providers": [{"name": "p", "base_url": "ftp://x", "models": ["m"]}]}`, "base_url"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": []}]}`, "at least one model"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"]}, {"name": "p", "base_url": "http://y/v1", "models": ["m"]}]}`, "duplicate"},
		{`{"providers": [{"name": "sim", "base_url": "http://x/v1", "models": ["m"]}]}`, "reserved"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"], "api_key_env": "A", "api_key_file": "f"}]}`, "exclusive"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"]}], "models": {"a": {"chain": ["q/m"]}}}`, "unknown provider"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"]}], "models": {"a": {"chain": ["p/z"]}}}`, "has no model"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"]}], "models": {"a": {"chain": []}}}`, "chain"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"]}], "models": {"a": {"chain": ["p/m"], "degrade_to": "p"}}}`, "degrade_to"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"], "timeout": "soon"}]}`, "soon"},
		{`{"providers": [], "cache": {"max_entries": -1}}`, "max_entries"},
		{`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"], "timeout": "-1s"}]}`, "must not be negative"},
		{`{"providers": [], "breaker": {"ratio": 2}}`, "breaker"},
		{`{"providers": [], "extra": 1}`, "unknown field"},
	} {
		_, err := ParseFile([]byte(tc.file))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one mentioning %q", tc.file, err, tc.want)
		}
	}
	// A key variable that is empty stops the start.
	f, err := ParseFile([]byte(`{"providers": [{"name": "p", "base_url": "http://x/v1", "models": ["m"], "api_key_env": "CURFEW_TEST_NO_SUCH_KEY"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewRouter(f, RouterOptions{Getenv: func(string) string { return "" }}); err == nil || !strings.Contains(err.Error(), "CURFEW_TEST_NO_SUCH_KEY") {
		t.Fatalf("NewRouter with an empty key variable: %v", err)
	}
}

// A cached answer expires after the TTL.
func TestCacheExpires(t *testing.T) {
	c := NewCache(2, time.Minute)
	now := time.Unix(1000, 0)
	c.now = func() time.Time { return now }
	k := [32]byte{1}
	c.put(k, &cached{text: "a"})
	if _, ok := c.get(k); !ok {
		t.Fatal("fresh entry missing")
	}
	now = now.Add(time.Minute)
	if _, ok := c.get(k); ok {
		t.Fatal("entry outlived its TTL")
	}
	for i := range 3 {
		c.put([32]byte{byte(i + 2)}, &cached{})
	}
	if c.Len() != 2 {
		t.Fatalf("len %d, want 2 (max entries)", c.Len())
	}
}

// A 429 and a provider that does not answer within its timeout fall back too, each with
// its reason on the node; an alias marked cacheable caches a non-deterministic call.
func TestFallbackReasonsAndCacheableAlias(t *testing.T) {
	pe := newProviderEnv(t, `{"providers": [
	    {"name": "limited", "base_url": "{limited}", "models": ["m"]},
	    {"name": "slow", "base_url": "{slow}", "models": ["m"], "timeout": "200ms"},
	    {"name": "backup", "base_url": "{backup}", "models": ["m"]}],
	  "models": {"chain": {"chain": ["limited/m", "slow/m", "backup/m"], "cacheable": true}}}`, "limited", "slow", "backup")
	pe.up["limited"].Enqueue(openaitest.Reply{Status: 429, RetryAfter: "1", Error: ptr(openaitest.ErrorFor(429))})
	pe.up["slow"].Enqueue(openaitest.Reply{HeaderDelay: 3 * time.Second, Content: openaitest.Tokens(2)})
	pe.up["backup"].Handle(func(openaitest.Request) openaitest.Reply { return openaitest.Reply{Content: openaitest.Tokens(3)} })
	req := &modelproxyv1.GenerateRequest{Model: "chain", Messages: userMsg("x")}
	chunks, err := generate(ident("rr", "root/m0"), t, pe.model, req)
	if err != nil || last(chunks).GetProvider() != "backup" {
		t.Fatalf("%v from %v", err, last(chunks))
	}
	n := meshtest.WaitNode(t, pe.srv.Nodes, "rr", "root/m0")
	fb := n.GetFallbacks()
	if len(fb) != 2 || fb[0].GetProvider() != "limited" || fb[0].GetReason() != ReasonRateLimited ||
		fb[1].GetProvider() != "slow" || fb[1].GetReason() != ReasonTimeout {
		t.Fatalf("fallbacks %v", fb)
	}
	// The alias is cacheable: the same call again is answered from the cache.
	again, err := generate(ident("rr", "root/m1"), t, pe.model, req)
	if err != nil || !last(again).GetCached() {
		t.Fatalf("second call: %v, %v", err, last(again))
	}
	if got := pe.up["backup"].Count(); got != 1 {
		t.Fatalf("backup saw %d requests, want 1", got)
	}
}

// ListModels answers sim and the file's aliases by name, each with its chain's first
// provider and model; the provider/model names are served but not listed.
func TestListModelsListsTheAliases(t *testing.T) {
	pe := newProviderEnv(t, `{"providers": [
	    {"name": "primary", "base_url": "{primary}", "models": ["big"]},
	    {"name": "backup", "base_url": "{backup}", "models": ["big", "small"]}],
	  "models": {"smart": {"chain": ["primary/big", "backup/big"]}, "fast": {"chain": ["backup/small"]}}}`, "primary", "backup")
	resp, err := pe.model.ListModels(context.Background(), &modelproxyv1.ListModelsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range resp.GetModels() {
		got = append(got, m.GetName()+"="+m.GetProvider()+"/"+m.GetProviderModel())
	}
	if want := []string{"sim=/", "fast=backup/small", "smart=primary/big"}; !slices.Equal(got, want) {
		t.Errorf("ListModels = %v, want %v", got, want)
	}
}
