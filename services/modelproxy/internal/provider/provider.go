package provider

import (
	"context"
	"time"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
)

// Request is one model step as a provider sees it: the alias already resolved to the
// provider's own model name.
type Request struct {
	Model    string
	Messages []*modelproxyv1.Message
	// Notes come after Messages for this call only (the agent loop's note of the time
	// left): a provider that takes a conversation sends them last; sim ignores them.
	Notes       []*modelproxyv1.Message
	Tools       []*modelproxyv1.ToolSpec
	MaxTokens   int
	Temperature *float64
	Seed        *int64
	// Schema, when set, asks the provider for a JSON answer valid against it (the
	// provider's structured-output mode where it has one). modelproxy validates the answer
	// itself; the provider only asks.
	Schema *modelproxyv1.ResponseSchema
	// Checked is what a Checker's Check found in the request (the sim model's step), for
	// its Stream of the same request to use rather than parse it again; nil otherwise.
	Checked any
}

// Chunk is one piece of a streamed answer.
type Chunk struct {
	// Delta is answer text.
	Delta string
	// Tokens is the completion tokens this chunk carries, counted as it arrives (one per
	// content or tool-call delta of the upstream stream), so that a stream cancelled
	// midway still has its spend recorded.
	Tokens int
	// ToolCalls are complete tool calls; set only on the final chunk.
	ToolCalls []*modelproxyv1.ToolCall
	// FinishReason is set on the final chunk: "stop", "length" or "tool_calls".
	FinishReason string
	// Usage is the provider's own count, when it reports one (stream_options.include_usage);
	// set only on the final chunk. It is authoritative over the sum of Tokens.
	Usage *modelproxyv1.Usage
}

// Stream is a started completion.
type Stream interface {
	// Recv returns the next chunk, or io.EOF after the final one. Errors are gRPC
	// statuses (see Provider).
	Recv() (*Chunk, error)
	// Close ends the stream and closes the upstream HTTP response at once, stopping the
	// provider's decoding. It is safe to call more than once and after io.EOF.
	Close() error
}

// Provider is one upstream inference service.
//
// Errors, from Stream and from Recv, are gRPC status errors that say what happened
// upstream, so that a fallback chain can tell a provider in trouble from a bad request:
//   - UNAVAILABLE: connection refused or reset, 502/503/504, other 5xx (the message names
//     the HTTP status);
//   - RESOURCE_EXHAUSTED: 429, with the provider's Retry-After as RetryInfo when it sent one;
//   - DEADLINE_EXCEEDED: no response headers or no first chunk within the provider's
//     timeout, or the caller's deadline;
//   - CANCELED: the caller's context was cancelled;
//   - INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED: 400, 404, 403, 401.
//
// ErrorInfo on the status carries Reason (one of the Reason* constants) and, in its
// metadata, "http_status" when there was a response.
type Provider interface {
	// Name is the provider's configured name.
	Name() string
	// Stream starts a streamed completion. It returns once the upstream has accepted the
	// request (response headers arrived) or failed. Cancelling ctx at any time closes the
	// upstream stream.
	Stream(ctx context.Context, req *Request) (Stream, error)
}

// ErrorInfo reasons and domain on provider errors.
const (
	ErrorDomain       = "modelproxy.curfew.dev"
	ReasonUnavailable = "PROVIDER_UNAVAILABLE"
	ReasonRateLimited = "PROVIDER_RATE_LIMITED"
	ReasonServerError = "PROVIDER_SERVER_ERROR"
	ReasonTimeout     = "PROVIDER_TIMEOUT"
	ReasonRejected    = "PROVIDER_REJECTED" // 4xx other than 429
)

// DefaultTimeout bounds the wait for a provider's response headers and first chunk.
const DefaultTimeout = 30 * time.Second

// Checker is implemented by a provider that can refuse a request before any decoder
// starts for it (the sim model refuses a conversation without a valid plan). The proxy
// calls Check before it records the call's node and lease, and returns its error, a gRPC
// status, as is. Check may set req.Checked.
type Checker interface {
	Check(req *Request) error
}

// Detached is implemented by a Stream that decodes under a context of its own rather than
// the one Stream was given, so that its caller's cancel does not stop it. The proxy then
// keeps draining it after its caller has gone (every token it emits still reaches the
// ledger), judges how the decoder ended by Context, and calls Stop when the decoder's lease
// lapses. Close ends Context too; the proxy closes the stream once it has recorded that
// end.
type Detached interface {
	Stream
	// Context is the context the stream decodes under.
	Context() context.Context
	// Stop tells the decoder that its lease lapsed, with cause; it may ignore it.
	Stop(cause error)
}
