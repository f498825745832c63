package provider

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/openaitest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testKey = "sk-test-0123456789abcdef"

// Bounds for "at once" on a loaded 2-core machine under -race: what a cancel must beat.
// Typical figures are a few milliseconds; the tests log them.
const promptBound = 500 * time.Millisecond

func newProvider(t *testing.T, srv *openaitest.Server, timeout time.Duration) *OpenAI {
	t.Helper()
	p, err := NewOpenAI(OpenAIConfig{Name: "test", BaseURL: srv.URL(), APIKey: testKey, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.CloseIdleConnections)
	return p
}

func userRequest(text string) *Request {
	return &Request{Model: "gpt-test", Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: text}}}
}

// drain receives until the stream ends; it returns the chunks and the error (nil at
// io.EOF), closing the stream.
func drain(t *testing.T, st Stream) ([]*Chunk, error) {
	t.Helper()
	defer func() { _ = st.Close() }()
	var out []*Chunk
	for {
		c, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, c)
	}
}

// summary is what a stream delivered: text, tokens counted and the final chunk.
func summary(t *testing.T, chunks []*Chunk) (text string, tokens int, final *Chunk) {
	t.Helper()
	if len(chunks) == 0 {
		t.Fatal("no chunks")
	}
	var sb strings.Builder
	for i, c := range chunks {
		last := i == len(chunks)-1
		if !last && (c.FinishReason != "" || c.Usage != nil || len(c.ToolCalls) > 0) {
			t.Fatalf("chunk %d of %d carries final fields: %+v", i, len(chunks), c)
		}
		sb.WriteString(c.Delta)
		tokens += c.Tokens
	}
	final = chunks[len(chunks)-1]
	if final.FinishReason == "" || final.Tokens != 0 || final.Delta != "" {
		t.Fatalf("final chunk %+v: want a finish reason, no delta, no tokens", final)
	}
	return sb.String(), tokens, final
}

// wantError fails unless err is a status with code and, when reason is set, an ErrorInfo
// with that reason and http_status (httpStatus 0: none); no reason means no ErrorInfo.
func wantError(t *testing.T, err error, code codes.Code, reason string, httpStatus int) *status.Status {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok || st.Code() != code {
		t.Fatalf("error = %v, want code %v", err, code)
	}
	gotReason, gotHTTP := ErrorReason(err)
	if gotReason != reason || gotHTTP != httpStatus {
		t.Fatalf("error %v: reason %q http_status %d, want %q %d", err, gotReason, gotHTTP, reason, httpStatus)
	}
	if strings.Contains(st.Message(), testKey) || strings.Contains(err.Error(), testKey) {
		t.Fatalf("error leaks the API key: %v", err)
	}
	return st
}

func retryInfo(st *status.Status) *time.Duration {
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			v := ri.GetRetryDelay().AsDuration()
			return &v
		}
	}
	return nil
}

func TestStreamContentWithUsage(t *testing.T) {
	srv := openaitest.New(t)
	srv.Enqueue(openaitest.Reply{Content: openaitest.Words("The quick brown fox."), Usage: &openaitest.Usage{PromptTokens: 12, CompletionTokens: 4}})
	p := newProvider(t, srv, 0)
	st, err := p.Stream(context.Background(), userRequest("hi"))
	if err != nil {
		t.Fatal(err)
	}
	chunks, err := drain(t, st)
	if err != nil {
		t.Fatal(err)
	}
	text, tokens, final := summary(t, chunks)
	if text != "The quick brown fox." || tokens != 4 {
		t.Fatalf("text %q tokens %d, want %q 4", text, tokens, "The quick brown fox.")
	}
	if final.FinishReason != "stop" || !proto.Equal(final.Usage, &modelproxyv1.Usage{PromptTokens: 12, CompletionTokens: 4}) || len(final.ToolCalls) != 0 {
		t.Fatalf("final chunk %+v", final)
	}
	// After the end: io.EOF again, and Close is harmless, twice.
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("Recv after the end = %v, want io.EOF", err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if c, _ := srv.Wait(context.Background(), 0); !c.Completed || c.ClientGone {
		t.Fatalf("server call %+v: want completed, client not gone", c)
	}
}

func TestStreamWithoutUsageReportsNone(t *testing.T) {
	srv := openaitest.New(t)
	srv.Enqueue(openaitest.Reply{Content: openaitest.Tokens(3), NoUsage: true, FinishReason: "length"})
	st, err := newProvider(t, srv, 0).Stream(context.Background(), userRequest("hi"))
	if err != nil {
		t.Fatal(err)
	}
	chunks, err := drain(t, st)
	if err != nil {
		t.Fatal(err)
	}
	_, tokens, final := summary(t, chunks)
	if tokens != 3 || final.Usage != nil || final.FinishReason != "length" {
		t.Fatalf("tokens %d final %+v: want 3 tokens, no usage, length", tokens, final)
	}
}

func TestToolCallsAssembledFromFragments(t *testing.T) {
	srv := openaitest.New(t)
	calls := []openaitest.ToolCall{
		{ID: "call_a", Name: "sleep", Arguments: `{"ms": 2000}`, Fragments: 4},
		{ID: "call_b", Name: "spawn_subagent", Arguments: `{"plan": {"steps": [{"think_tokens": 400}]}, "note": "héllo"}`, Fragments: 7},
	}
	srv.Enqueue(openaitest.Reply{Content: openaitest.Words("Let me check."), ToolCalls: calls})
	st, err := newProvider(t, srv, 0).Stream(context.Background(), userRequest("go"))
	if err != nil {
		t.Fatal(err)
	}
	chunks, err := drain(t, st)
	if err != nil {
		t.Fatal(err)
	}
	text, tokens, final := summary(t, chunks)
	want := []*modelproxyv1.ToolCall{
		{Id: "call_a", Name: "sleep", ArgsJson: `{"ms": 2000}`},
		{Id: "call_b", Name: "spawn_subagent", ArgsJson: calls[1].Arguments},
	}
	if len(final.ToolCalls) != len(want) {
		t.Fatalf("tool calls %v, want %v", final.ToolCalls, want)
	}
	for i := range want {
		if !proto.Equal(final.ToolCalls[i], want[i]) {
			t.Fatalf("tool call %d = %v, want %v", i, final.ToolCalls[i], want[i])
		}
	}
	if text != "Let me check." || final.FinishReason != "tool_calls" {
		t.Fatalf("text %q finish %q", text, final.FinishReason)
	}
	// One token per content chunk and per tool-call chunk (a header and its fragments):
	// the count the server reports too.
	if wantTokens := 3 + (1 + 4) + (1 + 7); tokens != wantTokens || final.Usage.GetCompletionTokens() != int64(wantTokens) {
		t.Fatalf("tokens counted %d, usage %v, want %d both", tokens, final.Usage, wantTokens)
	}
}

func TestToolCallsOnlyAndStopFinishNormalised(t *testing.T) {
	srv := openaitest.New(t)
	// No content at all (the role rides on the first tool-call chunk), and a server that
	// finishes a tool-calling answer with "stop", as some compatible ones do.
	srv.Enqueue(openaitest.Reply{ToolCalls: []openaitest.ToolCall{{Name: "deploy", Arguments: `{"env":"prod"}`}}, FinishReason: "stop"})
	st, err := newProvider(t, srv, 0).Stream(context.Background(), userRequest("go"))
	if err != nil {
		t.Fatal(err)
	}
	chunks, err := drain(t, st)
	if err != nil {
		t.Fatal(err)
	}
	text, _, final := summary(t, chunks)
	if text != "" || final.FinishReason != "tool_calls" || len(final.ToolCalls) != 1 ||
		!proto.Equal(final.ToolCalls[0], &modelproxyv1.ToolCall{Id: "call_0", Name: "deploy", ArgsJson: `{"env":"prod"}`}) {
		t.Fatalf("text %q final %+v", text, final)
	}
}

// A stream cancelled midway has its spend counted: every chunk received carried its
// tokens, and the server wrote no more content than the client could have counted plus
// what was in flight.
func TestCancelledStreamTokensCounted(t *testing.T) {
	srv := openaitest.New(t)
	srv.Enqueue(openaitest.Reply{Content: openaitest.Tokens(100000), Interval: 2 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := newProvider(t, srv, 0).Stream(ctx, userRequest("count"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	counted, received := 0, 0
	for received < 20 {
		c, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		counted += c.Tokens
		received++
	}
	cancel()
	// Recv after the cancel drains nothing more than what already arrived, then CANCELED.
	for {
		c, err := st.Recv()
		if err != nil {
			wantError(t, err, codes.Canceled, "", 0)
			break
		}
		counted += c.Tokens
		received++
	}
	call, err := srv.Wait(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	serverTokens := call.Chunks - 1 // the role chunk carries none
	t.Logf("client counted %d tokens in %d chunks; server wrote %d content chunks", counted, received, serverTokens)
	if counted != received || counted < 20 {
		t.Fatalf("counted %d tokens in %d chunks: want one per chunk, at least 20", counted, received)
	}
	if serverTokens < counted {
		t.Fatalf("server wrote %d content chunks, client counted %d", serverTokens, counted)
	}
	if !call.ClientGone || call.Completed || call.ChunksAfterGone != 0 {
		t.Fatalf("server call %+v: want the client gone mid-stream and no chunk after", call)
	}
}

// Cancelling the caller's context, or closing the stream (while Recv is blocked, from
// another goroutine), closes the upstream response at once: the server sees its request
// end within promptBound and writes nothing more.
func TestCancelClosesUpstreamAtOnce(t *testing.T) {
	for _, how := range []string{"cancel", "close"} {
		t.Run(how, func(t *testing.T) {
			srv := openaitest.New(t)
			// Slow enough that Recv is blocked when the stop comes, fast enough that a
			// stream left open would write many more chunks within the bound.
			srv.Enqueue(openaitest.Reply{Content: openaitest.Tokens(100000), Interval: 20 * time.Millisecond})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			st, err := newProvider(t, srv, 0).Stream(ctx, userRequest("long"))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = st.Close() }()
			for range 3 {
				if _, err := st.Recv(); err != nil {
					t.Fatal(err)
				}
			}
			recvErr := make(chan error, 1)
			go func() {
				for {
					if _, err := st.Recv(); err != nil {
						recvErr <- err
						return
					}
				}
			}()
			time.Sleep(5 * time.Millisecond) // let Recv block on the next chunk
			stopAt := time.Now()
			if how == "cancel" {
				cancel()
			} else {
				_ = st.Close()
			}
			select {
			case err := <-recvErr:
				wantError(t, err, codes.Canceled, "", 0)
			case <-time.After(promptBound):
				t.Fatalf("Recv still blocked %s after %s", promptBound, how)
			}
			wctx, wcancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer wcancel()
			call, err := srv.Wait(wctx, 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: server saw the client go after %s, handler ended after %s; %d chunks written",
				how, call.GoneAt.Sub(stopAt), call.End.Sub(stopAt), call.Chunks)
			if !call.ClientGone || call.Completed {
				t.Fatalf("server call %+v: want the client gone mid-stream", call)
			}
			if d := call.GoneAt.Sub(stopAt); d > promptBound {
				t.Fatalf("server saw the client go %s after the %s, want within %s", d, how, promptBound)
			}
			if d := call.End.Sub(stopAt); d > promptBound {
				t.Fatalf("server request ended %s after the %s, want within %s", d, how, promptBound)
			}
			if call.ChunksAfterGone != 0 || call.LastChunk.After(call.GoneAt) {
				t.Fatalf("server wrote %d chunks after the client went (last at %s, gone at %s)",
					call.ChunksAfterGone, call.LastChunk, call.GoneAt)
			}
		})
	}
}

func TestRateLimitedWithRetryAfter(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		name   string
		reply  openaitest.Reply
		lo, hi time.Duration // RetryInfo bounds; hi 0: no RetryInfo
	}{
		{"seconds", openaitest.Reply{Status: 429, RetryAfter: "7"}, 7 * time.Second, 7 * time.Second},
		{"http date", openaitest.Reply{Status: 429, RetryAfter: now.Add(30 * time.Second).UTC().Format(http.TimeFormat)}, 20 * time.Second, 31 * time.Second},
		{"date in the past", openaitest.Reply{Status: 429, RetryAfter: now.Add(-time.Hour).UTC().Format(http.TimeFormat)}, 0, 0},
		{"milliseconds header", openaitest.Reply{Status: 429, RetryAfter: "1", Header: http.Header{"Retry-After-Ms": {"250"}}}, 250 * time.Millisecond, 250 * time.Millisecond},
		{"none", openaitest.Reply{Status: 429}, 0, -1},
		{"malformed", openaitest.Reply{Status: 429, RetryAfter: "soon"}, 0, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := openaitest.New(t)
			srv.Enqueue(tc.reply)
			_, err := newProvider(t, srv, 0).Stream(context.Background(), userRequest("hi"))
			st := wantError(t, err, codes.ResourceExhausted, ReasonRateLimited, 429)
			got := retryInfo(st)
			switch {
			case tc.hi < 0 && got != nil:
				t.Fatalf("RetryInfo %s, want none", *got)
			case tc.hi >= 0 && (got == nil || *got < tc.lo || *got > tc.hi):
				t.Fatalf("RetryInfo %v, want in [%s, %s]", got, tc.lo, tc.hi)
			}
			if n := srv.Count(); n != 1 {
				t.Fatalf("server saw %d requests, want 1 (no SDK retries)", n)
			}
		})
	}
}

func TestHTTPErrorsMapped(t *testing.T) {
	for _, tc := range []struct {
		reply  openaitest.Reply
		code   codes.Code
		reason string
	}{
		{openaitest.Reply{Status: 503}, codes.Unavailable, ReasonUnavailable},
		{openaitest.Reply{Status: 502, RawBody: "<html>Bad Gateway</html>"}, codes.Unavailable, ReasonUnavailable},
		{openaitest.Reply{Status: 504}, codes.Unavailable, ReasonUnavailable},
		{openaitest.Reply{Status: 500}, codes.Unavailable, ReasonServerError},
		{openaitest.Reply{Status: 500, RawBody: "Internal Server Error"}, codes.Unavailable, ReasonServerError},
		{openaitest.Reply{Status: 400, Error: &openaitest.APIError{Message: "max_tokens is too large", Type: "invalid_request_error", Param: "max_tokens"}}, codes.InvalidArgument, ReasonRejected},
		{openaitest.Reply{Status: 401}, codes.Unauthenticated, ReasonRejected},
		{openaitest.Reply{Status: 403}, codes.PermissionDenied, ReasonRejected},
		{openaitest.Reply{Status: 404}, codes.NotFound, ReasonRejected},
		{openaitest.Reply{Status: 422}, codes.InvalidArgument, ReasonRejected},
		{openaitest.Reply{Status: 405}, codes.FailedPrecondition, ReasonRejected},
		{openaitest.Reply{Status: 408}, codes.Unavailable, ReasonUnavailable},
	} {
		t.Run(http.StatusText(tc.reply.Status), func(t *testing.T) {
			srv := openaitest.New(t)
			srv.Enqueue(tc.reply)
			_, err := newProvider(t, srv, 0).Stream(context.Background(), userRequest("hi"))
			st := wantError(t, err, tc.code, tc.reason, tc.reply.Status)
			if want := http.StatusText(tc.reply.Status); !strings.Contains(st.Message(), want) || !strings.Contains(st.Message(), `"test"`) {
				t.Fatalf("message %q does not name the HTTP status %q and the provider", st.Message(), want)
			}
			if tc.reply.Error != nil && !strings.Contains(st.Message(), tc.reply.Error.Message) {
				t.Fatalf("message %q lacks the provider's %q", st.Message(), tc.reply.Error.Message)
			}
			if n := srv.Count(); n != 1 {
				t.Fatalf("server saw %d requests, want exactly 1 (the SDK must not retry)", n)
			}
		})
	}
}

func TestAPIKeyNeverInErrors(t *testing.T) {
	srv := openaitest.New(t)
	srv.RequireAPIKey("sk-other")
	srv.Enqueue(openaitest.Reply{Status: 400, Error: &openaitest.APIError{Message: "key " + testKey + " is malformed", Type: "invalid_request_error"}})
	p := newProvider(t, srv, 0)
	_, err := p.Stream(context.Background(), userRequest("hi"))
	wantError(t, err, codes.Unauthenticated, ReasonRejected, 401)
	srv.RequireAPIKey("")
	_, err = p.Stream(context.Background(), userRequest("hi")) // a server that echoes the key
	st := wantError(t, err, codes.InvalidArgument, ReasonRejected, 400)
	if !strings.Contains(st.Message(), "[redacted]") {
		t.Fatalf("message %q: want the echoed key redacted", st.Message())
	}
	if got := srv.Requests()[0].Header.Get("Authorization"); got != "Bearer "+testKey {
		t.Fatalf("Authorization %q", got)
	}
}

func TestMidStreamFailures(t *testing.T) {
	for _, tc := range []struct {
		name   string
		reply  openaitest.Reply
		code   codes.Code
		reason string
	}{
		{"error event", openaitest.Reply{Content: openaitest.Tokens(3), StreamError: &openaitest.APIError{Message: "The server had an error", Type: "server_error"}}, codes.Unavailable, ReasonServerError},
		{"rate limit event", openaitest.Reply{Content: openaitest.Tokens(3), StreamError: &openaitest.APIError{Message: "slow down", Type: "requests", Code: "rate_limit_exceeded"}}, codes.ResourceExhausted, ReasonRateLimited},
		{"connection reset", openaitest.Reply{Content: openaitest.Tokens(3), Reset: true}, codes.Unavailable, ReasonUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := openaitest.New(t)
			srv.Enqueue(tc.reply)
			st, err := newProvider(t, srv, 0).Stream(context.Background(), userRequest("hi"))
			if err != nil {
				t.Fatal(err)
			}
			chunks, err := drain(t, st)
			wantError(t, err, tc.code, tc.reason, 0)
			tokens := 0
			for _, c := range chunks {
				tokens += c.Tokens
			}
			if tokens != 3 {
				t.Fatalf("counted %d tokens before the failure, want 3", tokens)
			}
			if _, again := st.Recv(); status.Code(again) != tc.code {
				t.Fatalf("Recv after the failure = %v, want the same error", again)
			}
		})
	}
}

func TestStreamWithoutDoneStillEnds(t *testing.T) {
	srv := openaitest.New(t)
	srv.Enqueue(openaitest.Reply{Content: openaitest.Tokens(2), NoDone: true})
	st, err := newProvider(t, srv, 0).Stream(context.Background(), userRequest("hi"))
	if err != nil {
		t.Fatal(err)
	}
	chunks, err := drain(t, st)
	if err != nil {
		t.Fatal(err)
	}
	if _, tokens, final := summary(t, chunks); tokens != 2 || final.FinishReason != "stop" {
		t.Fatalf("tokens %d final %+v", tokens, final)
	}
}

func TestStreamCutBeforeFinishIsUnavailable(t *testing.T) {
	// A server that ends its response cleanly in the middle of an answer.
	hs := newRawServer(t, "data: {\"id\":\"x\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"half\"},\"finish_reason\":null}]}\n\n")
	p, err := NewOpenAI(OpenAIConfig{Name: "test", BaseURL: hs + "/v1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.CloseIdleConnections)
	st, err := p.Stream(context.Background(), userRequest("hi"))
	if err != nil {
		t.Fatal(err)
	}
	chunks, err := drain(t, st)
	wantError(t, err, codes.Unavailable, ReasonServerError, 0)
	if len(chunks) != 1 || chunks[0].Delta != "half" || chunks[0].Tokens != 1 {
		t.Fatalf("chunks %+v", chunks)
	}
}

// newRawServer serves body as an event stream to every request, on loopback.
func newRawServer(t *testing.T, body string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{ReadHeaderTimeout: 5 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, body)
	})}
	done := make(chan struct{})
	go func() { defer close(done); _ = hs.Serve(l) }()
	t.Cleanup(func() { _ = hs.Close(); <-done })
	return "http://" + l.Addr().String()
}

func TestProviderTimeout(t *testing.T) {
	const timeout = 100 * time.Millisecond
	t.Run("no headers", func(t *testing.T) {
		srv := openaitest.New(t)
		srv.Enqueue(openaitest.Reply{HeaderDelay: time.Minute, Content: openaitest.Tokens(1)})
		start := time.Now()
		_, err := newProvider(t, srv, timeout).Stream(context.Background(), userRequest("hi"))
		elapsed := time.Since(start)
		wantError(t, err, codes.DeadlineExceeded, ReasonTimeout, 0)
		if elapsed < timeout || elapsed > timeout+promptBound {
			t.Fatalf("timed out after %s, want about %s", elapsed, timeout)
		}
		call, err := srv.Wait(context.Background(), 0)
		if err != nil || !call.ClientGone || call.Status != 0 {
			t.Fatalf("server call %+v (%v): want the client gone before headers", call, err)
		}
	})
	t.Run("no first chunk", func(t *testing.T) {
		srv := openaitest.New(t)
		srv.Enqueue(openaitest.Reply{FirstChunkDelay: time.Minute, Content: openaitest.Tokens(1)})
		st, err := newProvider(t, srv, timeout).Stream(context.Background(), userRequest("hi"))
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		_, err = drain(t, st)
		elapsed := time.Since(start)
		st2 := wantError(t, err, codes.DeadlineExceeded, ReasonTimeout, 0)
		if !strings.Contains(st2.Message(), "first chunk") || elapsed > timeout+promptBound {
			t.Fatalf("%v after %s", err, elapsed)
		}
		if call, err := srv.Wait(context.Background(), 0); err != nil || !call.ClientGone {
			t.Fatalf("server call %+v (%v): want the client gone", call, err)
		}
	})
	t.Run("does not bound the stream after the first chunk", func(t *testing.T) {
		srv := openaitest.New(t)
		// 10 chunks 40ms apart: the stream lasts about four timeouts.
		srv.Enqueue(openaitest.Reply{Content: openaitest.Tokens(10), Interval: 40 * time.Millisecond})
		st, err := newProvider(t, srv, timeout).Stream(context.Background(), userRequest("hi"))
		if err != nil {
			t.Fatal(err)
		}
		chunks, err := drain(t, st)
		if err != nil {
			t.Fatal(err)
		}
		if _, tokens, _ := summary(t, chunks); tokens != 10 {
			t.Fatalf("tokens %d, want 10", tokens)
		}
	})
}

// The caller's own deadline or cancel is not the provider's fault: plain
// DEADLINE_EXCEEDED or CANCELED, without ErrorInfo.
func TestCallerDeadlineAndCancel(t *testing.T) {
	t.Run("deadline before headers", func(t *testing.T) {
		srv := openaitest.New(t)
		srv.Enqueue(openaitest.Reply{HeaderDelay: time.Minute})
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		_, err := newProvider(t, srv, 10*time.Second).Stream(ctx, userRequest("hi"))
		wantError(t, err, codes.DeadlineExceeded, "", 0)
	})
	t.Run("deadline mid-stream", func(t *testing.T) {
		srv := openaitest.New(t)
		srv.Enqueue(openaitest.Reply{Content: openaitest.Tokens(2), Hang: true})
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		st, err := newProvider(t, srv, 10*time.Second).Stream(ctx, userRequest("hi"))
		if err != nil {
			t.Fatal(err)
		}
		chunks, err := drain(t, st)
		wantError(t, err, codes.DeadlineExceeded, "", 0)
		if len(chunks) != 2 {
			t.Fatalf("got %d chunks before the deadline, want 2", len(chunks))
		}
	})
	t.Run("deadline shorter than the provider timeout", func(t *testing.T) {
		srv := openaitest.New(t)
		srv.Enqueue(openaitest.Reply{FirstChunkDelay: time.Minute})
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		st, err := newProvider(t, srv, 5*time.Second).Stream(ctx, userRequest("hi"))
		if err != nil {
			t.Fatal(err)
		}
		_, err = drain(t, st)
		wantError(t, err, codes.DeadlineExceeded, "", 0)
	})
	t.Run("cancel before headers", func(t *testing.T) {
		srv := openaitest.New(t)
		srv.Enqueue(openaitest.Reply{HeaderDelay: time.Minute})
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(50*time.Millisecond, cancel)
		_, err := newProvider(t, srv, 10*time.Second).Stream(ctx, userRequest("hi"))
		wantError(t, err, codes.Canceled, "", 0)
	})
	t.Run("already cancelled", func(t *testing.T) {
		srv := openaitest.New(t)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_, err := newProvider(t, srv, 0).Stream(ctx, userRequest("hi"))
		wantError(t, err, codes.Canceled, "", 0)
		if n := srv.Count(); n != 0 {
			t.Fatalf("server saw %d requests, want none", n)
		}
	})
}

func TestConnectionRefused(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	p, err := NewOpenAI(OpenAIConfig{Name: "gone", BaseURL: "http://" + addr + "/v1", APIKey: testKey})
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Stream(context.Background(), userRequest("hi"))
	wantError(t, err, codes.Unavailable, ReasonUnavailable, 0)
}

func TestRequestBodyMapping(t *testing.T) {
	srv := openaitest.New(t)
	temp, seed := 0.0, int64(42)
	params := `{"type":"object","properties":{"ms":{"type":"integer","minimum":0}},"required":["ms"],"additionalProperties":false}`
	schema := `{"type":"object","properties":{"answer":{"type":"string"}},"required":["answer"]}`
	req := &Request{
		Model: "gpt-test",
		Messages: []*modelproxyv1.Message{
			{Role: modelproxyv1.Role_ROLE_SYSTEM, Content: "be brief"},
			{Role: modelproxyv1.Role_ROLE_USER, Content: "sleep a bit"},
			{Role: modelproxyv1.Role_ROLE_ASSISTANT, ToolCalls: []*modelproxyv1.ToolCall{
				{Id: "call_1", Name: "sleep", ArgsJson: `{"ms":5}`}, {Id: "call_2", Name: "noop"}}},
			{Role: modelproxyv1.Role_ROLE_TOOL, ToolCallId: "call_1", Content: `{"slept_ms":5}`},
			{Role: modelproxyv1.Role_ROLE_TOOL, ToolCallId: "call_2", Content: "ok"},
			{Role: modelproxyv1.Role_ROLE_ASSISTANT, Content: "done"},
			{Role: modelproxyv1.Role_ROLE_USER, Content: "answer in JSON"},
		},
		Tools: []*modelproxyv1.ToolSpec{
			{Name: "sleep", Description: "sleeps", ParametersJson: params},
			{Name: "noop"},
		},
		MaxTokens:   64,
		Temperature: &temp,
		Seed:        &seed,
		Schema:      &modelproxyv1.ResponseSchema{Name: "answer", SchemaJson: schema},
	}
	st, err := newProvider(t, srv, 0).Stream(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := drain(t, st); err != nil {
		t.Fatal(err)
	}
	got := srv.Requests()
	if len(got) != 1 {
		t.Fatalf("%d requests", len(got))
	}
	r := got[0]
	c := r.Chat
	if r.Method != http.MethodPost || r.Path != "/v1/chat/completions" || r.Header.Get("Authorization") != "Bearer "+testKey {
		t.Fatalf("request %s %s auth %q", r.Method, r.Path, r.Header.Get("Authorization"))
	}
	if c.Model != "gpt-test" || !c.Stream || !c.IncludeUsage() {
		t.Fatalf("model %q stream %v include_usage %v", c.Model, c.Stream, c.IncludeUsage())
	}
	if c.Temperature == nil || *c.Temperature != 0 || c.Seed == nil || *c.Seed != 42 ||
		c.MaxTokens == nil || *c.MaxTokens != 64 || c.MaxCompletionTokens != nil {
		t.Fatalf("temperature %v seed %v max_tokens %v max_completion_tokens %v", c.Temperature, c.Seed, c.MaxTokens, c.MaxCompletionTokens)
	}
	wantMsgs := []openaitest.Message{
		{Role: "system", Content: "be brief"},
		{Role: "user", Content: "sleep a bit"},
		{Role: "assistant", ToolCalls: []openaitest.MessageToolCall{
			{ID: "call_1", Type: "function", Function: openaitest.FunctionCall{Name: "sleep", Arguments: `{"ms":5}`}},
			{ID: "call_2", Type: "function", Function: openaitest.FunctionCall{Name: "noop", Arguments: `{}`}}}},
		{Role: "tool", ToolCallID: "call_1", Content: `{"slept_ms":5}`},
		{Role: "tool", ToolCallID: "call_2", Content: "ok"},
		{Role: "assistant", Content: "done"},
		{Role: "user", Content: "answer in JSON"},
	}
	if !reflect.DeepEqual(c.Messages, wantMsgs) {
		t.Fatalf("messages\n got %+v\nwant %+v", c.Messages, wantMsgs)
	}
	// The assistant turn that only called tools carries no content at all.
	var raw struct {
		Messages []map[string]json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(r.Body, &raw); err != nil {
		t.Fatal(err)
	}
	if _, has := raw.Messages[2]["content"]; has {
		t.Fatalf("tool-calling assistant message sends content: %s", raw.Messages[2]["content"])
	}
	if len(c.Tools) != 2 || c.Tools[0].Type != "function" || c.Tools[0].Function.Name != "sleep" ||
		c.Tools[0].Function.Description != "sleeps" || !jsonEqual(t, c.Tools[0].Function.Parameters, params) ||
		c.Tools[1].Function.Name != "noop" || c.Tools[1].Function.Parameters != nil {
		t.Fatalf("tools %+v", c.Tools)
	}
	rf := c.ResponseFormat
	if rf == nil || rf.Type != "json_schema" || rf.JSONSchema == nil || rf.JSONSchema.Name != "answer" || !jsonEqual(t, rf.JSONSchema.Schema, schema) {
		t.Fatalf("response_format %+v", rf)
	}
}

func TestRequestBodyOmitsUnsetOptions(t *testing.T) {
	srv := openaitest.New(t)
	p, err := NewOpenAI(OpenAIConfig{Name: "local", BaseURL: srv.URL()}) // no API key
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.CloseIdleConnections)
	st, err := p.Stream(context.Background(), userRequest("hi"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := drain(t, st); err != nil {
		t.Fatal(err)
	}
	r := srv.Requests()[0]
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(r.Body, &raw); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"temperature", "seed", "max_tokens", "max_completion_tokens", "tools", "response_format", "n"} {
		if v, ok := raw[k]; ok {
			t.Errorf("body sends %s = %s", k, v)
		}
	}
	if a := r.Header.Get("Authorization"); a != "" {
		t.Errorf("Authorization %q sent without an API key", a)
	}
}

func jsonEqual(t *testing.T, got json.RawMessage, want string) bool {
	t.Helper()
	var a, b any
	if err := json.Unmarshal(got, &a); err != nil {
		t.Fatalf("%s: %v", got, err)
	}
	if err := json.Unmarshal([]byte(want), &b); err != nil {
		t.Fatal(err)
	}
	return reflect.DeepEqual(a, b)
}

func TestInvalidRequestsNeverSent(t *testing.T) {
	srv := openaitest.New(t)
	p := newProvider(t, srv, 0)
	user := &modelproxyv1.Message{Role: modelproxyv1.Role_ROLE_USER, Content: "hi"}
	for name, req := range map[string]*Request{
		"nil":                 nil,
		"no model":            {Messages: []*modelproxyv1.Message{user}},
		"no messages":         {Model: "m"},
		"unspecified role":    {Model: "m", Messages: []*modelproxyv1.Message{{Content: "x"}}},
		"tool without id":     {Model: "m", Messages: []*modelproxyv1.Message{user, {Role: modelproxyv1.Role_ROLE_TOOL, Content: "x"}}},
		"tool params not obj": {Model: "m", Messages: []*modelproxyv1.Message{user}, Tools: []*modelproxyv1.ToolSpec{{Name: "t", ParametersJson: "[1]"}}},
		"tool without name":   {Model: "m", Messages: []*modelproxyv1.Message{user}, Tools: []*modelproxyv1.ToolSpec{{}}},
		"schema not JSON":     {Model: "m", Messages: []*modelproxyv1.Message{user}, Schema: &modelproxyv1.ResponseSchema{SchemaJson: "{"}},
		"negative max tokens": {Model: "m", Messages: []*modelproxyv1.Message{user}, MaxTokens: -1},
	} {
		_, err := p.Stream(context.Background(), req)
		if status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: error %v, want INVALID_ARGUMENT", name, err)
		}
	}
	if n := srv.Count(); n != 0 {
		t.Fatalf("server saw %d requests, want none", n)
	}
}

func TestNewOpenAIValidates(t *testing.T) {
	for name, cfg := range map[string]OpenAIConfig{
		"no name":             {BaseURL: "http://127.0.0.1:1/v1"},
		"bad name":            {Name: "a b", BaseURL: "http://127.0.0.1:1/v1"},
		"no base URL":         {Name: "p"},
		"unparsable base URL": {Name: "p", BaseURL: "http://[::1"},
		"scheme":              {Name: "p", BaseURL: "ftp://host/v1"},
		"no host":             {Name: "p", BaseURL: "http:///v1"},
		"credentials in URL":  {Name: "p", BaseURL: "https://user:" + testKey + "@host/v1"},
		"query":               {Name: "p", BaseURL: "https://host/v1?key=x"},
		"key with newline":    {Name: "p", BaseURL: "https://host/v1", APIKey: testKey + "\n"},
		"negative timeout":    {Name: "p", BaseURL: "https://host/v1", Timeout: -time.Second},
	} {
		_, err := NewOpenAI(cfg)
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		if strings.Contains(err.Error(), testKey) {
			t.Errorf("%s: error leaks the key: %v", name, err)
		}
	}
	p, err := NewOpenAI(OpenAIConfig{Name: "openai", BaseURL: "https://api.openai.com/v1", APIKey: testKey})
	if err != nil {
		t.Fatal(err)
	}
	if p.Name() != "openai" || p.timeout != DefaultTimeout {
		t.Fatalf("name %q timeout %s", p.Name(), p.timeout)
	}
}

// The SDK's environment defaults must not reach a provider: a key or header set for
// the OpenAI SDK in the environment is not sent to a configured provider.
func TestIgnoresSDKEnvironment(t *testing.T) {
	t.Setenv("OPENAI_API_KEY", "sk-from-env")
	t.Setenv("OPENAI_ORG_ID", "org-env")
	t.Setenv("OPENAI_BASE_URL", "http://127.0.0.1:1/v1")
	srv := openaitest.New(t)
	p, err := NewOpenAI(OpenAIConfig{Name: "local", BaseURL: srv.URL()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.CloseIdleConnections)
	st, err := p.Stream(context.Background(), userRequest("hi"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := drain(t, st); err != nil {
		t.Fatal(err)
	}
	h := srv.Requests()[0].Header
	if h.Get("Authorization") != "" || h.Get("OpenAI-Organization") != "" {
		t.Fatalf("environment leaked into the request: %v", h)
	}
}

func TestRetryAfterParsing(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	d := func(v time.Duration) *time.Duration { return &v }
	for _, tc := range []struct {
		h    http.Header
		want *time.Duration
	}{
		{nil, nil},
		{http.Header{}, nil},
		{http.Header{"Retry-After": {"0"}}, d(0)},
		{http.Header{"Retry-After": {" 12 "}}, d(12 * time.Second)},
		{http.Header{"Retry-After": {"-3"}}, nil},
		{http.Header{"Retry-After": {"1.5"}}, nil},
		{http.Header{"Retry-After": {"99999999999999999999"}}, nil},
		{http.Header{"Retry-After": {now.Add(90 * time.Second).Format(http.TimeFormat)}}, d(90 * time.Second)},
		{http.Header{"Retry-After": {now.Add(-time.Minute).Format(http.TimeFormat)}}, d(0)},
		{http.Header{"Retry-After-Ms": {"1500.5"}, "Retry-After": {"2"}}, d(1500*time.Millisecond + 500*time.Microsecond)},
		{http.Header{"Retry-After-Ms": {"nope"}, "Retry-After": {"2"}}, d(2 * time.Second)},
	} {
		got := retryAfter(tc.h, now)
		if (got == nil) != (tc.want == nil) || got != nil && *got != *tc.want {
			t.Errorf("retryAfter(%v) = %v, want %v", tc.h, got, tc.want)
		}
	}
}

// A stream that finished keeps its connection for the next call; one that failed or was
// cancelled does not.
func TestConnectionReusedAfterCompleteStream(t *testing.T) {
	srv := openaitest.New(t)
	p := newProvider(t, srv, 0)
	for range 3 {
		st, err := p.Stream(context.Background(), userRequest("hi"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := drain(t, st); err != nil {
			t.Fatal(err)
		}
	}
	reqs := srv.Requests()
	if reqs[0].RemoteAddr != reqs[1].RemoteAddr || reqs[1].RemoteAddr != reqs[2].RemoteAddr {
		t.Fatalf("three streams over %s, %s, %s: want one connection", reqs[0].RemoteAddr, reqs[1].RemoteAddr, reqs[2].RemoteAddr)
	}
	// A cancelled stream's connection is gone: the next call opens another.
	srv.Enqueue(openaitest.Reply{Content: openaitest.Tokens(1000), Interval: 5 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	st, err := p.Stream(ctx, userRequest("hi"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	_, _ = drain(t, st)
	st, err = p.Stream(context.Background(), userRequest("hi"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := drain(t, st); err != nil {
		t.Fatal(err)
	}
	if reqs = srv.Requests(); reqs[4].RemoteAddr == reqs[3].RemoteAddr {
		t.Fatalf("the call after a cancelled stream reused its connection %s", reqs[3].RemoteAddr)
	}
}
