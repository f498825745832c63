package provider

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	openai "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/packages/param"
	"github.com/openai/openai-go/v3/packages/ssestream"
	"github.com/openai/openai-go/v3/shared"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
)

// OpenAIConfig configures an OpenAI-compatible provider. The zero value of each optional
// field is documented on it.
type OpenAIConfig struct {
	// Name is the provider's configured name (required): it names the provider in errors,
	// metrics and the run's node. Letters, digits, '.', '_' and '-'.
	Name string
	// BaseURL is the API root that "chat/completions" is appended to, e.g.
	// "https://api.openai.com/v1" or "http://127.0.0.1:11434/v1" (required; http or
	// https, with a host, without credentials, query or fragment).
	BaseURL string
	// APIKey is sent as "Authorization: Bearer <key>"; empty sends no Authorization header
	// (local servers). It never appears in errors.
	APIKey string
	// Timeout bounds the wait for the response headers and, after them, for the first
	// chunk of the stream; DefaultTimeout when 0. It does not bound the stream after its
	// first chunk: the caller's deadline does.
	Timeout time.Duration
	// HTTPClient is the client requests go through; nil means a client of the provider's
	// own (a clone of http.DefaultTransport), closed by CloseIdleConnections. Its Timeout
	// should be 0: it would cut long streams short.
	HTTPClient *http.Client
}

// OpenAI is a Provider for the OpenAI chat completions API and the servers compatible
// with it (ollama, vLLM, llama.cpp, LiteLLM, ...), through the official SDK.
//
// The SDK's own retries are off: curfew retries at one layer only, with its retry-id,
// budget and backoff, and a fallback chain must see each failure at once. The SDK's
// environment defaults (OPENAI_API_KEY, OPENAI_BASE_URL, OPENAI_ORG_ID, ...) are not read
// either: everything comes from OpenAIConfig, so one provider's settings cannot leak into
// requests to another.
//
// Requests are streamed chat completions with stream_options.include_usage; Request
// maps onto the body as follows: messages role by role (an assistant turn carries its
// tool_calls, a tool turn its tool_call_id), Tools as function tools with the ToolSpec's
// JSON Schema as parameters, Schema as response_format {type: json_schema}, MaxTokens as
// max_tokens (understood by ollama and most compatible servers; 0 omits it), Temperature
// and Seed when set.
//
// Streams: each chunk of the upstream stream that carries content (or a refusal) or a
// tool-call delta becomes one Chunk with Tokens 1 (Delta empty for a tool-call delta), so
// the sum of Tokens is the spend seen so far, also when the stream is cancelled. The
// final Chunk (after [DONE]) has no Delta and no Tokens: FinishReason ("stop", "length",
// "tool_calls", or the server's own, e.g. "content_filter"; a server that finishes a
// tool-calling answer with "stop" is read as "tool_calls"), the tool calls assembled from
// their deltas by index (an id the server did not send is "call_<n>", empty arguments are
// "{}"), and Usage when the server sent a usage chunk.
//
// Errors follow Provider, plus: 413 and 422 are INVALID_ARGUMENT; 408 and 409 are
// UNAVAILABLE (transient by OpenAI's own rules); other 4xx are FAILED_PRECONDITION; all
// with ErrorInfo reason PROVIDER_REJECTED but 408 and 409 (PROVIDER_UNAVAILABLE). Inside
// the stream, an error event is UNAVAILABLE with PROVIDER_SERVER_ERROR (or
// RESOURCE_EXHAUSTED with PROVIDER_RATE_LIMITED for a rate-limit error), a broken
// connection is UNAVAILABLE with PROVIDER_UNAVAILABLE, and a stream that ends without a
// finish reason is UNAVAILABLE with PROVIDER_SERVER_ERROR (the answer may be cut). The
// ErrorInfo metadata also holds "provider", the provider's name. Stream and Recv return
// plain CANCELED or DEADLINE_EXCEEDED, without ErrorInfo, when the caller's context
// ended, and CANCELED when the stream was closed. A Request that cannot be sent (no
// model or messages, a tool message without tool_call_id, parameters or a schema that
// are not JSON) is INVALID_ARGUMENT without ErrorInfo, and no request is made.
type OpenAI struct {
	name    string
	apiKey  string
	timeout time.Duration
	http    *http.Client
	chat    openai.ChatCompletionService
}

var _ Provider = (*OpenAI)(nil)

// NewOpenAI validates cfg and returns the provider. It makes no request.
func NewOpenAI(cfg OpenAIConfig) (*OpenAI, error) {
	if err := validName(cfg.Name); err != nil {
		return nil, err
	}
	base, err := validBaseURL(cfg.BaseURL)
	if err != nil {
		return nil, fmt.Errorf("provider %q: %w", cfg.Name, err)
	}
	if strings.ContainsFunc(cfg.APIKey, func(r rune) bool { return r < 0x21 || r == 0x7f }) {
		// A header value with a newline would be refused by net/http at every request;
		// say so once, at start, without echoing the key.
		return nil, fmt.Errorf("provider %q: API key contains whitespace or control characters", cfg.Name)
	}
	if cfg.Timeout < 0 {
		return nil, fmt.Errorf("provider %q: negative timeout %s", cfg.Name, cfg.Timeout)
	}
	timeout := cfg.Timeout
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	hc := cfg.HTTPClient
	if hc == nil {
		tr, ok := http.DefaultTransport.(*http.Transport)
		if !ok {
			return nil, fmt.Errorf("provider %q: http.DefaultTransport is not an *http.Transport; set HTTPClient", cfg.Name)
		}
		hc = &http.Client{Transport: tr.Clone()}
	}
	opts := []option.RequestOption{
		option.WithBaseURL(base),
		option.WithHTTPClient(hc),
		option.WithMaxRetries(0),
	}
	if cfg.APIKey != "" {
		opts = append(opts, option.WithAPIKey(cfg.APIKey))
	}
	// NewChatCompletionService, unlike openai.NewClient, adds no defaults from the
	// environment.
	return &OpenAI{
		name:    cfg.Name,
		apiKey:  cfg.APIKey,
		timeout: timeout,
		http:    hc,
		chat:    openai.NewChatCompletionService(opts...),
	}, nil
}

func validName(name string) error {
	if name == "" {
		return errors.New("provider name is empty")
	}
	valid := func(r rune) bool {
		return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-'
	}
	if strings.ContainsFunc(name, func(r rune) bool { return !valid(r) }) {
		return fmt.Errorf("provider name %q: only letters, digits, '.', '_' and '-'", name)
	}
	return nil
}

func validBaseURL(raw string) (string, error) {
	if raw == "" {
		return "", errors.New("base URL is empty")
	}
	u, err := url.Parse(raw)
	if err != nil {
		// url.Error quotes the input, which may hold credentials: say less.
		return "", errors.New("base URL does not parse")
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("base URL scheme %q: want http or https", u.Scheme)
	case u.Host == "":
		return "", errors.New("base URL has no host")
	case u.User != nil:
		return "", errors.New("base URL carries credentials; use APIKey")
	case u.RawQuery != "" || u.Fragment != "":
		return "", errors.New("base URL has a query or fragment")
	}
	return u.String(), nil
}

// Name returns the provider's configured name.
func (p *OpenAI) Name() string { return p.name }

// CloseIdleConnections closes the idle keep-alive connections of the provider's HTTP
// client, for a clean shutdown.
func (p *OpenAI) CloseIdleConnections() { p.http.CloseIdleConnections() }

// errProviderTimeout and errStreamClosed are the causes the stream's own context is
// cancelled with, so that an ended request can be told apart from the caller's cancel.
var (
	errProviderTimeout = errors.New("provider timeout")
	errStreamClosed    = errors.New("stream closed")
)

// Stream starts a streamed completion; see Provider. The returned Stream must be closed.
func (p *OpenAI) Stream(ctx context.Context, req *Request) (Stream, error) {
	params, err := chatParams(req)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "provider %q: %v", p.name, err)
	}
	if err := ctx.Err(); err != nil {
		return nil, callerStatus(p.name, err)
	}
	sctx, cancel := context.WithCancelCause(ctx)
	timer := time.AfterFunc(p.timeout, func() { cancel(errProviderTimeout) })
	var (
		resp *http.Response
		body *heldBody
	)
	hold := func(r *http.Request, next option.MiddlewareNext) (*http.Response, error) {
		res, err := next(r)
		if res != nil && res.Body != nil {
			body = &heldBody{rc: res.Body}
			res.Body = body
		}
		return res, err
	}
	upstream := p.chat.NewStreaming(sctx, params, option.WithResponseInto(&resp), option.WithMiddleware(hold))
	if err := upstream.Err(); err != nil {
		timer.Stop()
		cancel(nil)
		_ = upstream.Close()
		body.close()
		return nil, p.status(ctx, sctx, resp, err, "response headers")
	}
	return &openAIStream{p: p, ctx: ctx, sctx: sctx, cancel: cancel, timer: timer, upstream: upstream, body: body,
		calls: map[int64]*modelproxyv1.ToolCall{}}, nil
}

// heldBody is the upstream response body with the SDK's Close taken away from it. The
// SDK closes the body as soon as it reads [DONE], before the response's own end (the
// chunked encoding's last chunk) may have arrived, and net/http drops a connection closed
// early: the next call then pays for a new connection (a TLS handshake to a remote
// HTTP/1.1 provider; about one call in twenty on loopback). The stream closes the body
// itself instead, after reading the response's end when it finished normally, so the
// connection goes back to the pool.
type heldBody struct {
	rc   io.ReadCloser
	once sync.Once
}

func (b *heldBody) Read(p []byte) (int, error) { return b.rc.Read(p) }

// Close is the SDK's close: nothing; the stream calls close or drainAndClose.
func (b *heldBody) Close() error { return nil }

// close closes the body. Safe on nil and more than once.
func (b *heldBody) close() {
	if b == nil {
		return
	}
	b.once.Do(func() { _ = b.rc.Close() })
}

// drainAndClose reads what is left of a finished response, at most drainMax bytes and
// for at most drainWait (then cancel ends the request), and closes the body.
func (b *heldBody) drainAndClose(cancel func()) {
	if b == nil {
		return
	}
	b.once.Do(func() {
		t := time.AfterFunc(drainWait, cancel)
		_, _ = io.CopyN(io.Discard, b.rc, drainMax)
		t.Stop()
		_ = b.rc.Close()
	})
}

// How long and how much Close reads of a response after its [DONE] to keep the connection:
// a server normally ends the response right after [DONE], so this costs microseconds; one
// that keeps it open loses the connection.
const (
	drainWait = 20 * time.Millisecond
	drainMax  = 64 << 10
)

// chatParams maps a Request onto the chat completions body.
func chatParams(req *Request) (openai.ChatCompletionNewParams, error) {
	var params openai.ChatCompletionNewParams
	if req == nil {
		return params, errors.New("nil request")
	}
	if req.Model == "" {
		return params, errors.New("no model")
	}
	if len(req.Messages) == 0 {
		return params, errors.New("no messages")
	}
	if req.MaxTokens < 0 {
		return params, fmt.Errorf("negative max tokens %d", req.MaxTokens)
	}
	params.Model = req.Model
	params.StreamOptions.IncludeUsage = param.NewOpt(true)
	for i, m := range req.Messages {
		msg, err := chatMessage(m)
		if err != nil {
			return params, fmt.Errorf("message %d: %w", i, err)
		}
		params.Messages = append(params.Messages, msg)
	}
	for i, m := range req.Notes {
		msg, err := chatMessage(m)
		if err != nil {
			return params, fmt.Errorf("note %d: %w", i, err)
		}
		params.Messages = append(params.Messages, msg)
	}
	for _, t := range req.Tools {
		if t.GetName() == "" {
			return params, errors.New("tool without a name")
		}
		def := shared.FunctionDefinitionParam{Name: t.GetName()}
		if d := t.GetDescription(); d != "" {
			def.Description = param.NewOpt(d)
		}
		if pj := t.GetParametersJson(); pj != "" {
			var schema shared.FunctionParameters
			if err := json.Unmarshal([]byte(pj), &schema); err != nil {
				return params, fmt.Errorf("tool %q: parameters are not a JSON object: %w", t.GetName(), err)
			}
			def.Parameters = schema
		}
		params.Tools = append(params.Tools, openai.ChatCompletionFunctionTool(def))
	}
	if s := req.Schema; s != nil {
		if !json.Valid([]byte(s.GetSchemaJson())) {
			return params, errors.New("response schema is not valid JSON")
		}
		name := s.GetName()
		if name == "" {
			name = "response"
		}
		params.ResponseFormat.OfJSONSchema = &shared.ResponseFormatJSONSchemaParam{
			JSONSchema: shared.ResponseFormatJSONSchemaJSONSchemaParam{Name: name, Schema: json.RawMessage(s.GetSchemaJson())},
		}
	}
	if req.MaxTokens > 0 {
		params.MaxTokens = param.NewOpt(int64(req.MaxTokens))
	}
	if req.Temperature != nil {
		params.Temperature = param.NewOpt(*req.Temperature)
	}
	if req.Seed != nil {
		params.Seed = param.NewOpt(*req.Seed)
	}
	return params, nil
}

func chatMessage(m *modelproxyv1.Message) (openai.ChatCompletionMessageParamUnion, error) {
	switch m.GetRole() {
	case modelproxyv1.Role_ROLE_SYSTEM:
		return openai.SystemMessage(m.GetContent()), nil
	case modelproxyv1.Role_ROLE_USER:
		return openai.UserMessage(m.GetContent()), nil
	case modelproxyv1.Role_ROLE_ASSISTANT:
		var a openai.ChatCompletionAssistantMessageParam
		// An assistant turn that only called tools has no content; one that did neither
		// still needs one.
		if m.GetContent() != "" || len(m.GetToolCalls()) == 0 {
			a.Content.OfString = param.NewOpt(m.GetContent())
		}
		for _, tc := range m.GetToolCalls() {
			args := tc.GetArgsJson()
			if args == "" {
				args = "{}"
			}
			a.ToolCalls = append(a.ToolCalls, openai.ChatCompletionMessageToolCallUnionParam{
				OfFunction: &openai.ChatCompletionMessageFunctionToolCallParam{
					ID:       tc.GetId(),
					Function: openai.ChatCompletionMessageFunctionToolCallFunctionParam{Name: tc.GetName(), Arguments: args},
				},
			})
		}
		return openai.ChatCompletionMessageParamUnion{OfAssistant: &a}, nil
	case modelproxyv1.Role_ROLE_TOOL:
		if m.GetToolCallId() == "" {
			return openai.ChatCompletionMessageParamUnion{}, errors.New("tool message without tool_call_id")
		}
		return openai.ToolMessage(m.GetContent(), m.GetToolCallId()), nil
	default:
		return openai.ChatCompletionMessageParamUnion{}, fmt.Errorf("unsupported role %s", m.GetRole())
	}
}

// openAIStream is a started completion. Recv is for one goroutine; Close may be called
// from any goroutine, concurrently with Recv.
type openAIStream struct {
	p        *OpenAI
	ctx      context.Context // the caller's
	sctx     context.Context // the request's: the caller's, cancelled by timeout or Close
	cancel   context.CancelCauseFunc
	timer    *time.Timer // the first-chunk timeout, stopped at the first chunk
	upstream *ssestream.Stream[openai.ChatCompletionChunk]
	body     *heldBody // nil when no response arrived

	closeOnce sync.Once
	finished  atomic.Bool // the upstream sent its whole answer: Close may keep the connection

	// Owned by Recv.
	first   bool
	err     error // sticky: returned again by every later Recv
	finish  string
	usage   *modelproxyv1.Usage
	calls   map[int64]*modelproxyv1.ToolCall // assembled by tool-call index
	pending []*Chunk                         // chunks decoded but not yet returned
}

// Recv returns the next chunk; see Stream.
func (s *openAIStream) Recv() (*Chunk, error) {
	for {
		if len(s.pending) > 0 {
			c := s.pending[0]
			s.pending = s.pending[1:]
			return c, nil
		}
		if s.err != nil {
			return nil, s.err
		}
		s.err = s.next()
	}
}

// next reads one upstream event into pending, or returns the error that ends the
// stream (io.EOF after the final chunk has been queued).
func (s *openAIStream) next() error {
	if !s.upstream.Next() {
		err := s.upstream.Err()
		const stage = "first chunk" // the provider's timeout ends only the wait for it
		if err == nil && s.sctx.Err() != nil {
			// The SDK ends quietly when Close won the race with its read.
			err = context.Cause(s.sctx)
		}
		if err != nil {
			s.end()
			return s.p.status(s.ctx, s.sctx, nil, err, stage)
		}
		if s.finish == "" {
			// Without [DONE] or a finish reason the answer may be cut: the upstream went
			// away cleanly mid-answer.
			s.end()
			return s.p.unavailable(ReasonServerError, 0, "stream ended without a finish reason")
		}
		// The request stays open until Close, which reads the response's end so that
		// the connection can be reused.
		s.timer.Stop()
		s.finished.Store(true)
		s.pending = append(s.pending, s.final())
		return io.EOF
	}
	if !s.first {
		s.first = true
		s.timer.Stop()
	}
	ch := s.upstream.Current()
	if ch.JSON.Usage.Valid() {
		s.usage = &modelproxyv1.Usage{PromptTokens: ch.Usage.PromptTokens, CompletionTokens: ch.Usage.CompletionTokens}
	}
	for _, c := range ch.Choices {
		if c.Index != 0 {
			continue // n is never set: one choice
		}
		if c.FinishReason != "" {
			s.finish = c.FinishReason
		}
		d := c.Delta
		text := d.Content + d.Refusal // a refusal is the answer the caller gets
		if text == "" && len(d.ToolCalls) == 0 {
			continue
		}
		for _, tc := range d.ToolCalls {
			call := s.calls[tc.Index]
			if call == nil {
				call = &modelproxyv1.ToolCall{}
				s.calls[tc.Index] = call
			}
			if tc.ID != "" {
				call.Id = tc.ID
			}
			if tc.Function.Name != "" {
				call.Name += tc.Function.Name
			}
			call.ArgsJson += tc.Function.Arguments
		}
		s.pending = append(s.pending, &Chunk{Delta: text, Tokens: 1})
	}
	return nil
}

// final is the last chunk: the assembled tool calls, the finish reason and the usage.
func (s *openAIStream) final() *Chunk {
	c := &Chunk{FinishReason: s.finish, Usage: s.usage}
	idx := make([]int64, 0, len(s.calls))
	for i := range s.calls {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	for n, i := range idx {
		call := s.calls[i]
		if call.Id == "" {
			call.Id = fmt.Sprintf("call_%d", n) // some compatible servers send none
		}
		if call.ArgsJson == "" {
			call.ArgsJson = "{}"
		}
		c.ToolCalls = append(c.ToolCalls, call)
	}
	if len(c.ToolCalls) > 0 && (c.FinishReason == "stop" || c.FinishReason == "function_call") {
		// Some compatible servers finish a tool-calling answer with "stop".
		c.FinishReason = "tool_calls"
	}
	return c
}

// end releases a request that failed: it stops the timer, cancels the request's context
// (which drops the connection) and closes the upstream body.
func (s *openAIStream) end() {
	s.timer.Stop()
	s.cancel(nil)
	_ = s.upstream.Close()
	s.body.close()
}

// Close ends the stream and closes the upstream response at once. After a complete
// answer it first reads the response's end (bounded by drainWait) to keep the connection.
func (s *openAIStream) Close() error {
	s.closeOnce.Do(func() {
		s.timer.Stop()
		if s.finished.Load() {
			s.body.drainAndClose(func() { s.cancel(errStreamClosed) })
		}
		// Cancelling the request's context makes the transport close the connection at
		// once, even while Recv is blocked reading it; closing the body then is cleanup.
		s.cancel(errStreamClosed)
		_ = s.upstream.Close()
		s.body.close()
	})
	return nil
}

// callerStatus is the status for the caller's own context ending.
func callerStatus(name string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return status.Errorf(codes.DeadlineExceeded, "provider %q: caller's deadline exceeded", name)
	}
	return status.Errorf(codes.Canceled, "provider %q: cancelled by the caller", name)
}

// status maps an error of the request or of the stream to a gRPC status; see Provider.
// ctx is the caller's context, sctx the request's; resp is the HTTP response when one
// arrived; stage names what was being waited for, for a timeout's message.
func (p *OpenAI) status(ctx, sctx context.Context, resp *http.Response, err error, stage string) error {
	// The cause says who ended the request first: the provider's timer, the caller, or
	// Close.
	switch cause := context.Cause(sctx); {
	case errors.Is(cause, errProviderTimeout):
		return p.withInfo(codes.DeadlineExceeded, ReasonTimeout, 0, nil,
			fmt.Sprintf("no %s within %s", stage, p.timeout))
	case ctx.Err() != nil:
		return callerStatus(p.name, ctx.Err())
	case errors.Is(cause, errStreamClosed):
		return status.Errorf(codes.Canceled, "provider %q: stream closed", p.name)
	}
	var apiErr *openai.Error
	if errors.As(err, &apiErr) {
		var h http.Header
		if apiErr.Response != nil {
			h = apiErr.Response.Header
		}
		return p.httpStatus(apiErr.StatusCode, h, apiErrorText(apiErr.Message, apiErr.Type, apiErr.Code))
	}
	if resp != nil && (resp.StatusCode < 200 || resp.StatusCode > 299) {
		// An error body the SDK could not read as OpenAI's error object.
		return p.httpStatus(resp.StatusCode, resp.Header, "")
	}
	var se *ssestream.StreamError
	if errors.As(err, &se) {
		return p.streamError(se)
	}
	var syn *json.SyntaxError
	if errors.As(err, &syn) {
		return p.unavailable(ReasonServerError, 0, "malformed chunk: "+err.Error())
	}
	return p.unavailable(ReasonUnavailable, 0, err.Error())
}

// httpStatus maps an HTTP error status; see Provider.
func (p *OpenAI) httpStatus(code int, h http.Header, detail string) error {
	msg := fmt.Sprintf("HTTP %d %s", code, http.StatusText(code))
	if detail != "" {
		msg += ": " + detail
	}
	switch {
	case code == http.StatusTooManyRequests:
		return p.withInfo(codes.ResourceExhausted, ReasonRateLimited, code, retryAfter(h, time.Now()), msg)
	case code == http.StatusBadRequest, code == http.StatusRequestEntityTooLarge, code == http.StatusUnprocessableEntity:
		return p.withInfo(codes.InvalidArgument, ReasonRejected, code, nil, msg)
	case code == http.StatusUnauthorized:
		return p.withInfo(codes.Unauthenticated, ReasonRejected, code, nil, msg)
	case code == http.StatusForbidden:
		return p.withInfo(codes.PermissionDenied, ReasonRejected, code, nil, msg)
	case code == http.StatusNotFound:
		return p.withInfo(codes.NotFound, ReasonRejected, code, nil, msg)
	case code == http.StatusRequestTimeout, code == http.StatusConflict:
		// Transient by OpenAI's own account (its SDKs retry them).
		return p.unavailable(ReasonUnavailable, code, msg)
	case code >= 400 && code < 500:
		return p.withInfo(codes.FailedPrecondition, ReasonRejected, code, nil, msg)
	case code == http.StatusBadGateway, code == http.StatusServiceUnavailable, code == http.StatusGatewayTimeout:
		return p.unavailable(ReasonUnavailable, code, msg)
	default:
		return p.unavailable(ReasonServerError, code, msg)
	}
}

// streamError maps an error event inside the stream ({"error": {...}} in place of a
// chunk): a rate limit stays a rate limit, anything else is the provider failing.
func (p *OpenAI) streamError(se *ssestream.StreamError) error {
	var body struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    any    `json:"code"`
		} `json:"error"`
	}
	_ = json.Unmarshal(se.Event.Data, &body)
	e := body.Error
	code := ""
	if e.Code != nil {
		code = fmt.Sprint(e.Code)
	}
	msg := "error event in stream"
	if t := apiErrorText(e.Message, e.Type, code); t != "" {
		msg += ": " + t
	}
	if strings.Contains(e.Type, "rate_limit") || strings.Contains(code, "rate_limit") {
		return p.withInfo(codes.ResourceExhausted, ReasonRateLimited, 0, nil, msg)
	}
	return p.unavailable(ReasonServerError, 0, msg)
}

func (p *OpenAI) unavailable(reason string, httpCode int, msg string) error {
	return p.withInfo(codes.Unavailable, reason, httpCode, nil, msg)
}

// withInfo builds a status with an ErrorInfo (and a RetryInfo when retry is set). The
// message names the provider and never holds the API key.
func (p *OpenAI) withInfo(c codes.Code, reason string, httpCode int, retry *time.Duration, msg string) error {
	return errorStatus(c, reason, p.name, httpCode, retry, p.redact(fmt.Sprintf("provider %q: %s", p.name, msg)))
}

// redact removes the API key from text that came from elsewhere (an upstream message, a
// transport error), in case a server echoes it.
func (p *OpenAI) redact(s string) string {
	if p.apiKey == "" {
		return s
	}
	return strings.ReplaceAll(s, p.apiKey, "[redacted]")
}

// apiErrorText joins the fields of an OpenAI error object, bounded in length.
func apiErrorText(message, typ, code string) string {
	var parts []string
	if typ != "" {
		parts = append(parts, typ)
	}
	if code != "" && code != typ {
		parts = append(parts, code)
	}
	text := strings.Join(parts, "/")
	if message != "" {
		if text != "" {
			text += ": "
		}
		text += message
	}
	const maxLen = 300
	if len(text) > maxLen {
		text = text[:maxLen] + "..."
	}
	return text
}
