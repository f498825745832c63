package openaitest

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// Reply scripts the server's answer to one request. The zero Reply streams an empty
// answer that finishes with "stop". Delays end early when the client goes away.
//
// In JSON (the control API and cmd/openaitest) fields are snake_case and durations are
// strings time.ParseDuration reads ("150ms").
type Reply struct {
	// Status, when neither 0 nor 200, answers with that HTTP status and an OpenAI error
	// body instead of a completion.
	Status int `json:"status,omitempty"`
	// Error is the error object of an error reply; when nil, one fitting Status.
	Error *APIError `json:"error,omitempty"`
	// RawBody, when set, is an error reply's body instead of the JSON error object, sent
	// as text/plain (a proxy's HTML page, say).
	RawBody string `json:"raw_body,omitempty"`
	// RetryAfter is sent verbatim as the Retry-After header ("2", or an HTTP date).
	RetryAfter string `json:"retry_after,omitempty"`
	// Header holds extra response headers, on any reply.
	Header http.Header `json:"header,omitempty"`

	// HeaderDelay is the wait before the response headers.
	HeaderDelay time.Duration `json:"-"`
	// FirstChunkDelay is the wait after the headers, before the first chunk.
	FirstChunkDelay time.Duration `json:"-"`
	// Interval is the wait before each chunk after the first: the decoding pace.
	Interval time.Duration `json:"-"`

	// Model is the chunks' "model"; the request's model when empty.
	Model string `json:"model,omitempty"`
	// Content is the answer, one element per chunk (a token each).
	Content []string `json:"content,omitempty"`
	// ToolCalls follow the content, each as a header chunk and argument fragments.
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
	// FinishReason is the final chunk's; "tool_calls" when there are tool calls, "stop"
	// otherwise, when empty.
	FinishReason string `json:"finish_reason,omitempty"`
	// Usage is the usage chunk's count; when nil, the prompt's words for prompt_tokens and
	// the content and tool-call chunks for completion_tokens (the count a client makes
	// by counting chunks).
	Usage *Usage `json:"usage,omitempty"`
	// NoUsage leaves the usage chunk out even when the request asked for it.
	NoUsage bool `json:"no_usage,omitempty"`

	// StreamError, when set, replaces the end of the stream (after the content and tool
	// calls): an SSE "error" event whose data is {"error": {...}}, then the response ends
	// without [DONE].
	StreamError *APIError `json:"stream_error,omitempty"`
	// Reset aborts the connection after the content and tool calls: no finish, no [DONE],
	// a broken chunked encoding (the client reads an unexpected EOF).
	Reset bool `json:"reset,omitempty"`
	// Hang keeps the response open after the content and tool calls, writing nothing,
	// until the client goes away.
	Hang bool `json:"hang,omitempty"`
	// NoDone ends the stream after the finish (and usage) chunk without "data: [DONE]".
	NoDone bool `json:"no_done,omitempty"`
	// IgnoreDisconnect keeps writing chunks after the client went away, until a write
	// fails, as a server that does not stop decoding on disconnect would; the chunks it
	// writes then are counted in Call.ChunksAfterGone.
	IgnoreDisconnect bool `json:"ignore_disconnect,omitempty"`
}

// ToolCall is a tool call of a Reply.
type ToolCall struct {
	// ID is the call's id; "call_<n>" when empty.
	ID   string `json:"id,omitempty"`
	Name string `json:"name"`
	// Arguments is the arguments JSON, streamed in Fragments pieces (3 when 0; never more
	// pieces than it has characters).
	Arguments string `json:"arguments"`
	Fragments int    `json:"fragments,omitempty"`
}

// Usage is a token count.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
}

// APIError is OpenAI's error object. Empty Param and Code are sent as null.
type APIError struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   string `json:"param,omitempty"`
	Code    string `json:"code,omitempty"`
}

// Tokens returns n content tokens "t1 ", "t2 ", ...
func Tokens(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("t%d ", i+1)
	}
	return out
}

// Words splits s into content tokens at spaces, each token but the first keeping its
// leading space, as tokenizers do: Words("a b") is ["a", " b"].
func Words(s string) []string {
	var out []string
	for i, w := range strings.Fields(s) {
		if i > 0 {
			w = " " + w
		}
		out = append(out, w)
	}
	return out
}

// ErrorFor returns the error object OpenAI sends with an HTTP status.
func ErrorFor(status int) APIError {
	switch {
	case status == http.StatusUnauthorized:
		return APIError{Message: "Incorrect API key provided.", Type: "invalid_request_error", Code: "invalid_api_key"}
	case status == http.StatusNotFound:
		return APIError{Message: "The model does not exist or you do not have access to it.", Type: "invalid_request_error", Code: "model_not_found"}
	case status == http.StatusTooManyRequests:
		return APIError{Message: "Rate limit reached for requests. Please try again later.", Type: "requests", Code: "rate_limit_exceeded"}
	case status == http.StatusServiceUnavailable:
		return APIError{Message: "The server is overloaded or not ready yet.", Type: "server_error"}
	case status >= 500:
		return APIError{Message: "The server had an error while processing your request.", Type: "server_error"}
	default:
		return APIError{Message: http.StatusText(status), Type: "invalid_request_error"}
	}
}

// replyJSON is Reply's JSON form: the durations as strings.
type replyJSON struct {
	HeaderDelay     string `json:"header_delay,omitempty"`
	FirstChunkDelay string `json:"first_chunk_delay,omitempty"`
	Interval        string `json:"interval,omitempty"`
}

// MarshalJSON encodes r with its durations as strings.
func (r Reply) MarshalJSON() ([]byte, error) {
	type plain Reply
	var d replyJSON
	if r.HeaderDelay != 0 {
		d.HeaderDelay = r.HeaderDelay.String()
	}
	if r.FirstChunkDelay != 0 {
		d.FirstChunkDelay = r.FirstChunkDelay.String()
	}
	if r.Interval != 0 {
		d.Interval = r.Interval.String()
	}
	return json.Marshal(struct {
		plain
		replyJSON
	}{plain(r), d})
}

// UnmarshalJSON decodes r, reading its durations from strings.
func (r *Reply) UnmarshalJSON(b []byte) error {
	type plain Reply
	var v struct {
		plain
		replyJSON
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*r = Reply(v.plain)
	for _, f := range []struct {
		s   string
		dst *time.Duration
	}{{v.replyJSON.HeaderDelay, &r.HeaderDelay}, {v.replyJSON.FirstChunkDelay, &r.FirstChunkDelay}, {v.replyJSON.Interval, &r.Interval}} {
		if f.s == "" {
			continue
		}
		d, err := time.ParseDuration(f.s)
		if err != nil {
			return err
		}
		*f.dst = d
	}
	return nil
}
