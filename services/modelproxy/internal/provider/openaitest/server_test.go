package openaitest

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func post(t *testing.T, s *Server, body string) (*http.Response, string) {
	t.Helper()
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	resp, err := (&http.Client{Transport: tr}).Post(s.URL()+"/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(b)
}

var created = regexp.MustCompile(`"created":\d+`)

// The stream is byte for byte what api.openai.com sends, but for the created time.
func TestStreamFormat(t *testing.T) {
	s := New(t)
	s.Enqueue(Reply{
		Content:   []string{"Hi", " there"},
		ToolCalls: []ToolCall{{ID: "call_x", Name: "f", Arguments: `{"a":1}`, Fragments: 2}},
		Usage:     &Usage{PromptTokens: 5, CompletionTokens: 6},
	})
	resp, body := post(t, s, `{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}`)
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" || resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d content type %q", resp.StatusCode, ct)
	}
	const head = `{"id":"chatcmpl-openaitest0","object":"chat.completion.chunk","created":0,"model":"m","system_fingerprint":"fp_openaitest","choices":[{"index":0,"delta":`
	want := "" +
		"data: " + head + `{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n" +
		"data: " + head + `{"content":"Hi"},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n" +
		"data: " + head + `{"content":" there"},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n" +
		"data: " + head + `{"tool_calls":[{"index":0,"id":"call_x","type":"function","function":{"name":"f","arguments":""}}]},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n" +
		"data: " + head + `{"tool_calls":[{"index":0,"function":{"arguments":"{\"a"}}]},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n" +
		"data: " + head + `{"tool_calls":[{"index":0,"function":{"arguments":"\":1}"}}]},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n" +
		"data: " + head + `{},"logprobs":null,"finish_reason":"tool_calls"}],"usage":null}` + "\n\n" +
		`data: {"id":"chatcmpl-openaitest0","object":"chat.completion.chunk","created":0,"model":"m","system_fingerprint":"fp_openaitest","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":6,"total_tokens":11}}` + "\n\n" +
		"data: [DONE]\n\n"
	if got := created.ReplaceAllString(body, `"created":0`); got != want {
		t.Fatalf("stream\n%s\nwant\n%s", got, want)
	}
	c, err := s.Wait(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if !c.Completed || c.ClientGone || c.Chunks != 8 || c.Status != 200 || !c.Request.Chat.IncludeUsage() {
		t.Fatalf("%v", c)
	}
}

func TestStreamWithoutUsageOptionHasNoUsageField(t *testing.T) {
	s := New(t)
	s.Enqueue(Reply{ToolCalls: []ToolCall{{Name: "f", Arguments: "{}", Fragments: 1}}})
	_, body := post(t, s, `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if strings.Contains(body, "usage") {
		t.Fatalf("usage sent without include_usage:\n%s", body)
	}
	// Only tool calls: the role rides on the first tool-call chunk, content null.
	first := strings.SplitN(body, "\n\n", 2)[0]
	if !strings.Contains(first, `"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_0","type":"function","function":{"name":"f","arguments":""}}],"refusal":null}`) {
		t.Fatalf("first chunk %s", first)
	}
	if !strings.HasSuffix(body, `"finish_reason":"tool_calls"}]}`+"\n\ndata: [DONE]\n\n") {
		t.Fatalf("stream end:\n%s", body)
	}
}

func TestNonStreamingCompletion(t *testing.T) {
	s := New(t)
	s.Enqueue(Reply{Content: Words("a b"), ToolCalls: []ToolCall{{ID: "c1", Name: "f", Arguments: `{"x":1}`}}})
	resp, body := post(t, s, `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"one two"}]}]}`)
	if resp.Header.Get("Content-Type") != "application/json" {
		t.Fatal(resp.Header)
	}
	var got completionJSON
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatal(err)
	}
	m := got.Choices[0].Message
	if got.Object != "chat.completion" || *m.Content != "a b" || len(m.ToolCalls) != 1 || m.ToolCalls[0].Function.Arguments != `{"x":1}` ||
		got.Choices[0].FinishReason != "tool_calls" || got.Usage.CompletionTokens != 2+1+3 || got.Usage.PromptTokens != 3 {
		t.Fatalf("%s", body)
	}
	if c := s.Requests()[0].Chat.Messages[0]; c.Content != "one two" {
		t.Fatalf("content parts decoded as %q", c.Content)
	}
}

func TestErrorReplies(t *testing.T) {
	s := New(t)
	s.Enqueue(Reply{Status: 429, RetryAfter: "3"}, Reply{Status: 502, RawBody: "bad gateway"})
	resp, body := post(t, s, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "3" ||
		body != `{"error":{"message":"Rate limit reached for requests. Please try again later.","type":"requests","param":null,"code":"rate_limit_exceeded"}}` {
		t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, body)
	}
	resp, body = post(t, s, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != http.StatusBadGateway || body != "bad gateway" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	resp, _ = post(t, s, `{"model":"m"}`)
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("no messages: %d", resp.StatusCode)
	}
	if n := s.Count(); n != 3 {
		t.Fatalf("%d calls", n)
	}
}

func TestHandleAndAPIKey(t *testing.T) {
	s := New(t)
	s.RequireAPIKey("k")
	s.Handle(func(r Request) Reply { return Reply{Content: []string{r.Chat.Model}} })
	resp, _ := post(t, s, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("without the key: %d", resp.StatusCode)
	}
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, s.URL()+"/chat/completions",
		strings.NewReader(`{"model":"echo-me","messages":[{"role":"user","content":"hi"}]}`))
	req.Header.Set("Authorization", "Bearer k")
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	r2, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(r2.Body)
	_ = r2.Body.Close()
	if !strings.Contains(string(b), `"content":"echo-me"`) {
		t.Fatalf("%s", b)
	}
}

// A client that goes away before the headers, or mid-stream, is recorded with when; the
// server writes nothing after.
func TestClientGone(t *testing.T) {
	s := New(t)
	s.Enqueue(Reply{HeaderDelay: time.Minute}, Reply{Content: Tokens(1000), Interval: 10 * time.Millisecond})
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	body := `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL()+"/chat/completions", strings.NewReader(body))
	if resp, err := hc.Do(req); err == nil {
		_ = resp.Body.Close()
		t.Fatal("headers arrived")
	}
	c, err := s.Wait(context.Background(), 0)
	if err != nil || !c.ClientGone || c.Status != 0 || c.Chunks != 0 {
		t.Fatalf("%v (%v)", c, err)
	}

	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	req, _ = http.NewRequestWithContext(ctx2, http.MethodPost, s.URL()+"/chat/completions", strings.NewReader(body))
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1)
	for i := 0; i < 3; {
		if _, err := resp.Body.Read(buf); err != nil {
			t.Fatal(err)
		}
		if buf[0] == '\n' {
			i++
		}
	}
	cancel2()
	_ = resp.Body.Close()
	c, err = s.Wait(context.Background(), 1)
	if err != nil || !c.ClientGone || c.Completed || c.Status != 200 || c.ChunksAfterGone != 0 || c.Chunks >= 1000 {
		t.Fatalf("%v (%v)", c, err)
	}
}

func TestIgnoreDisconnectEnds(t *testing.T) {
	s := New(t)
	s.Enqueue(Reply{Content: Tokens(100000), Interval: time.Millisecond, IgnoreDisconnect: true})
	ctx, cancel := context.WithCancel(context.Background())
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL()+"/chat/completions",
		strings.NewReader(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`))
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	_ = resp.Body.Close()
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	c, err := s.Wait(wctx, 0)
	if err != nil || !c.ClientGone {
		t.Fatalf("%v (%v)", c, err)
	}
	t.Logf("a server that ignores the disconnect wrote %d chunks after it", c.ChunksAfterGone)
}

// The control API of cmd/openaitest: replies as JSON with durations as strings, and the
// calls back.
func TestControlAPI(t *testing.T) {
	s := New(t)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	hc := &http.Client{Transport: tr}
	base := strings.TrimSuffix(s.URL(), "/v1")
	resp, err := hc.Post(base+"/_openaitest/replies", "application/json",
		strings.NewReader(`[{"content":["x","y"],"interval":"1ms","first_chunk_delay":"2ms","status":0}]`))
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatal(resp.Status)
	}
	post(t, s, `{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	if _, err := s.Wait(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	resp, err = hc.Get(base + "/_openaitest/calls")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var calls []Call
	if err := json.NewDecoder(resp.Body).Decode(&calls); err != nil {
		t.Fatal(err)
	}
	if len(calls) != 1 || calls[0].Reply.Interval != time.Millisecond || calls[0].Reply.FirstChunkDelay != 2*time.Millisecond ||
		len(calls[0].Reply.Content) != 2 || calls[0].Chunks != 4 || !calls[0].Completed {
		t.Fatalf("%+v", calls)
	}
	r := Reply{HeaderDelay: time.Second, Content: []string{"a"}}
	b, err := json.Marshal(r)
	if err != nil || !bytes.Contains(b, []byte(`"header_delay":"1s"`)) {
		t.Fatalf("%s %v", b, err)
	}
}
