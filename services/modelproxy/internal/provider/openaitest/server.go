package openaitest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// Server is an OpenAI-compatible HTTP server on loopback. It is safe for concurrent use.
type Server struct {
	hs *httptest.Server

	mu      sync.Mutex
	queue   []Reply
	handler func(Request) Reply
	apiKey  string
	calls   []*Call
	changed chan struct{} // closed and replaced whenever a call changes
}

// Request is a request as the server received it.
type Request struct {
	Method string
	Path   string
	// RemoteAddr is the client's address: requests with the same one came over the same
	// connection.
	RemoteAddr string
	Header     http.Header
	// Body is the raw body.
	Body []byte
	// Chat is the body decoded (zero when it did not decode).
	Chat ChatRequest
}

// Call is one request and what the server did with it.
type Call struct {
	// N is the call's index, from 0 in arrival order.
	N       int
	Request Request
	// Reply is the script the server followed (zero for a request refused before one
	// was chosen: bad body, wrong API key).
	Reply Reply
	// Status is the HTTP status written; 0 when the client went away before it.
	Status int
	// Start is when the request arrived; Headers when the response headers were written;
	// End when the handler returned (zero while it runs).
	Start, Headers, End time.Time
	// Chunks is the number of data chunks written ([DONE] not counted); LastChunk is
	// when the last of them started to be written.
	Chunks    int
	LastChunk time.Time
	// Completed reports that the reply was written to its scripted end.
	Completed bool
	// ClientGone reports that the request's context ended (the client closed the
	// connection, or the server was shut down) before the reply's end; GoneAt is when.
	ClientGone bool
	GoneAt     time.Time
	// ChunksAfterGone counts the chunks written after GoneAt. It stays 0 unless the
	// reply has IgnoreDisconnect: the server stops writing once the client is gone.
	ChunksAfterGone int
}

// String summarises the call (without the request body and the reply's content).
func (c Call) String() string {
	gone := "no"
	if c.ClientGone {
		gone = c.GoneAt.Sub(c.Start).String() + " after start"
	}
	return fmt.Sprintf("call %d %s %s model %q: status %d, %d chunks, completed %v, client gone %s, %d chunks after, ended %v",
		c.N, c.Request.Method, c.Request.Path, c.Request.Chat.Model, c.Status, c.Chunks, c.Completed, gone, c.ChunksAfterGone, c.Ended())
}

// Ended reports whether the call's handler has returned.
func (c Call) Ended() bool { return !c.End.IsZero() }

// DefaultReply answers requests no Enqueue'd reply or Handle function covers.
var DefaultReply = Reply{Content: Words("Hello from openaitest.")}

// New starts a server on loopback and closes it when the test ends.
func New(tb testing.TB) *Server {
	tb.Helper()
	s := Start()
	tb.Cleanup(s.Close)
	return s
}

// Start starts a server on a loopback port; Close it when done.
func Start() *Server {
	s := newServer()
	s.hs = httptest.NewServer(s)
	return s
}

// Serve starts a server on l (for cmd/openaitest); Close it when done.
func Serve(l net.Listener) *Server {
	s := newServer()
	s.hs = &httptest.Server{Listener: l, Config: &http.Server{Handler: s, ReadHeaderTimeout: 10 * time.Second}}
	s.hs.Start()
	return s
}

func newServer() *Server {
	return &Server{changed: make(chan struct{})}
}

// URL is the API base URL, ending in /v1 (the server answers POST /v1/chat/completions).
func (s *Server) URL() string { return s.hs.URL + "/v1" }

// Close shuts the server down: it closes every connection (a running call sees its
// client go) and waits for the handlers to return.
func (s *Server) Close() { s.hs.Close() }

// Enqueue adds replies, used one per request in arrival order.
func (s *Server) Enqueue(replies ...Reply) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.queue = append(s.queue, replies...)
}

// Handle sets the function that answers requests once the queue is empty (nil restores
// DefaultReply).
func (s *Server) Handle(h func(Request) Reply) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.handler = h
}

// RequireAPIKey makes the server refuse, with 401, chat requests that do not carry
// "Authorization: Bearer <key>". Empty accepts any (the default).
func (s *Server) RequireAPIKey(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.apiKey = key
}

// Calls returns a snapshot of every call so far, in arrival order.
func (s *Server) Calls() []Call {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Call, len(s.calls))
	for i, c := range s.calls {
		out[i] = *c
	}
	return out
}

// Requests returns the requests received so far, in arrival order.
func (s *Server) Requests() []Request {
	calls := s.Calls()
	out := make([]Request, len(calls))
	for i, c := range calls {
		out[i] = c.Request
	}
	return out
}

// Count returns the number of requests received so far.
func (s *Server) Count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.calls)
}

// Wait waits until call n (from 0) has ended, and returns it.
func (s *Server) Wait(ctx context.Context, n int) (Call, error) {
	for {
		s.mu.Lock()
		if n < len(s.calls) && s.calls[n].Ended() {
			c := *s.calls[n]
			s.mu.Unlock()
			return c, nil
		}
		ch := s.changed
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return Call{}, fmt.Errorf("openaitest: call %d has not ended: %w", n, ctx.Err())
		}
	}
}

// update changes a call under the lock and wakes waiters.
func (s *Server) update(c *Call, f func(c *Call)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(c)
	close(s.changed)
	s.changed = make(chan struct{})
}

// ServeHTTP serves the API:
//
//	POST /v1/chat/completions   the completion, streamed when "stream": true
//	GET  /v1/models             the models list (one model, "openaitest")
//
// and the control API of tests over real processes:
//
//	POST /_openaitest/replies   a JSON array of Reply, enqueued
//	GET  /_openaitest/calls     the calls so far, as a JSON array of Call
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/v1/chat/completions" && r.Method == http.MethodPost:
		s.chat(w, r)
	case r.URL.Path == "/v1/models" && r.Method == http.MethodGet:
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"openaitest","object":"model","created":0,"owned_by":"openaitest"}]}`)
	case r.URL.Path == "/_openaitest/replies" && r.Method == http.MethodPost:
		var replies []Reply
		if err := json.NewDecoder(r.Body).Decode(&replies); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		s.Enqueue(replies...)
		w.WriteHeader(http.StatusNoContent)
	case r.URL.Path == "/_openaitest/calls" && r.Method == http.MethodGet:
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.Calls())
	default:
		writeError(w, http.StatusNotFound, APIError{Message: "Unknown request URL: " + r.Method + " " + r.URL.Path, Type: "invalid_request_error"})
	}
}

func writeError(w http.ResponseWriter, status int, e APIError) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(errorBody(e))
}

// chat serves one chat completion request.
func (s *Server) chat(w http.ResponseWriter, r *http.Request) {
	// Reading the body to its end lets net/http watch the connection, so that the
	// request's context ends when the client goes away.
	body, err := io.ReadAll(r.Body)
	c := &Call{Start: time.Now(), Request: Request{Method: r.Method, Path: r.URL.Path, RemoteAddr: r.RemoteAddr, Header: r.Header.Clone(), Body: body}}
	decodeErr := err
	if err == nil {
		decodeErr = json.Unmarshal(body, &c.Request.Chat)
	}
	s.mu.Lock()
	c.N = len(s.calls)
	s.calls = append(s.calls, c)
	apiKey := s.apiKey
	s.mu.Unlock()

	a := &answer{s: s, c: c, w: w, ctx: r.Context()}
	// The context ends when the client goes away (or the server shuts down), and also
	// once the handler returns: only an end before the reply's end is a client gone.
	// The watcher sees it at once even while the handler sleeps or writes; wait and the
	// deferred check below see it too, whichever is first.
	stop := context.AfterFunc(r.Context(), a.gone)
	defer func() {
		stop()
		if r.Context().Err() != nil {
			a.gone()
		}
		s.update(c, func(c *Call) { c.End = time.Now() })
	}()

	switch {
	case apiKey != "" && r.Header.Get("Authorization") != "Bearer "+apiKey:
		a.fail(http.StatusUnauthorized, ErrorFor(http.StatusUnauthorized))
		return
	case decodeErr != nil:
		a.fail(http.StatusBadRequest, APIError{Message: "We could not parse the JSON body of your request.", Type: "invalid_request_error"})
		return
	case c.Request.Chat.Model == "":
		a.fail(http.StatusBadRequest, APIError{Message: "you must provide a model parameter", Type: "invalid_request_error", Param: "model"})
		return
	case len(c.Request.Chat.Messages) == 0:
		a.fail(http.StatusBadRequest, APIError{Message: "'messages' is a required property", Type: "invalid_request_error", Param: "messages"})
		return
	}
	reply := s.next(c.Request)
	s.update(c, func(c *Call) { c.Reply = reply })
	a.reply = reply
	a.run()
}

// next picks the reply to req: the queue's head, else the handler's, else DefaultReply.
func (s *Server) next(req Request) Reply {
	s.mu.Lock()
	if len(s.queue) > 0 {
		r := s.queue[0]
		s.queue = s.queue[1:]
		s.mu.Unlock()
		return r
	}
	h := s.handler
	s.mu.Unlock()
	if h != nil {
		return h(req)
	}
	return DefaultReply
}

// answer writes one reply.
type answer struct {
	s     *Server
	c     *Call
	w     http.ResponseWriter
	ctx   context.Context
	reply Reply

	id      string
	created int64
	model   string
}

// gone records that the client went away, unless the reply was already complete or the
// departure already recorded.
func (a *answer) gone() {
	now := time.Now()
	a.s.update(a.c, func(c *Call) {
		if !c.ClientGone && !c.Completed && c.End.IsZero() {
			c.ClientGone, c.GoneAt = true, now
		}
	})
}

// fail writes an error reply.
func (a *answer) fail(status int, e APIError) {
	a.s.update(a.c, func(c *Call) { c.Status, c.Headers = status, time.Now() })
	a.last(func() bool { writeError(a.w, status, e); return true })
}

// wait sleeps d, or until the client goes away; it reports whether the client is still
// there (or the reply ignores it).
func (a *answer) wait(d time.Duration) bool {
	if a.reply.IgnoreDisconnect {
		if d > 0 {
			time.Sleep(d)
		}
		return true
	}
	if d <= 0 {
		if a.ctx.Err() != nil {
			a.gone()
			return false
		}
		return true
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-a.ctx.Done():
		a.gone()
		return false
	}
}

func (a *answer) run() {
	rep := a.reply
	req := &a.c.Request.Chat
	if !a.wait(rep.HeaderDelay) {
		return
	}
	h := a.w.Header()
	for k, v := range rep.Header {
		h[k] = v
	}
	h.Set("X-Request-Id", fmt.Sprintf("req_openaitest_%d", a.c.N))
	if rep.RetryAfter != "" {
		h.Set("Retry-After", rep.RetryAfter)
	}
	if rep.Status != 0 && rep.Status != http.StatusOK {
		if rep.RawBody != "" {
			a.s.update(a.c, func(c *Call) { c.Status, c.Headers = rep.Status, time.Now() })
			h.Set("Content-Type", "text/plain; charset=utf-8")
			a.w.WriteHeader(rep.Status)
			a.last(func() bool { _, err := io.WriteString(a.w, rep.RawBody); return err == nil })
			return
		}
		e := ErrorFor(rep.Status)
		if rep.Error != nil {
			e = *rep.Error
		}
		a.fail(rep.Status, e)
		return
	}
	a.id = fmt.Sprintf("chatcmpl-openaitest%d", a.c.N)
	a.created = time.Now().Unix()
	a.model = rep.Model
	if a.model == "" {
		a.model = req.Model
	}
	if !req.Stream {
		a.complete()
		return
	}
	a.stream()
}

// complete writes a non-streamed chat.completion.
func (a *answer) complete() {
	rep := a.reply
	if !a.wait(rep.FirstChunkDelay) {
		return
	}
	msg := completionMessage{Role: "assistant", Refusal: jsonNull}
	if len(rep.Content) > 0 || len(rep.ToolCalls) == 0 {
		text := strings.Join(rep.Content, "")
		msg.Content = &text
	}
	for i, tc := range rep.ToolCalls {
		msg.ToolCalls = append(msg.ToolCalls, MessageToolCall{ID: toolCallID(tc, i), Type: "function",
			Function: FunctionCall{Name: tc.Name, Arguments: tc.Arguments}})
	}
	u := a.usage()
	body, _ := json.Marshal(completionJSON{ID: a.id, Object: "chat.completion", Created: a.created, Model: a.model,
		Choices:           []completionChoice{{Message: msg, Logprobs: jsonNull, FinishReason: a.finishReason()}},
		Usage:             usageJSON{PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens, TotalTokens: u.PromptTokens + u.CompletionTokens},
		SystemFingerprint: "fp_openaitest"})
	a.w.Header().Set("Content-Type", "application/json")
	a.s.update(a.c, func(c *Call) { c.Status, c.Headers = http.StatusOK, time.Now() })
	a.w.WriteHeader(http.StatusOK)
	a.last(func() bool { _, err := a.w.Write(body); return err == nil })
}

func toolCallID(tc ToolCall, i int) string {
	if tc.ID != "" {
		return tc.ID
	}
	return fmt.Sprintf("call_%d", i)
}

func (a *answer) finishReason() string {
	switch {
	case a.reply.FinishReason != "":
		return a.reply.FinishReason
	case len(a.reply.ToolCalls) > 0:
		return "tool_calls"
	default:
		return "stop"
	}
}

// usage is the reply's usage, or the default count (see Reply.Usage).
func (a *answer) usage() Usage {
	if a.reply.Usage != nil {
		return *a.reply.Usage
	}
	var u Usage
	for _, m := range a.c.Request.Chat.Messages {
		u.PromptTokens += len(strings.Fields(m.Content)) + 1
	}
	u.CompletionTokens = len(a.reply.Content)
	for _, tc := range a.reply.ToolCalls {
		u.CompletionTokens += 1 + len(fragments(tc))
	}
	return u
}

// fragments splits a tool call's arguments into its fragments, at rune boundaries.
func fragments(tc ToolCall) []string {
	runes := []rune(tc.Arguments)
	n := tc.Fragments
	if n <= 0 {
		n = 3
	}
	n = min(n, len(runes))
	out := make([]string, 0, n)
	for i := range n {
		out = append(out, string(runes[i*len(runes)/n:(i+1)*len(runes)/n]))
	}
	return out
}

// stream writes the reply as chat.completion.chunk events.
func (a *answer) stream() {
	rep := a.reply
	includeUsage := a.c.Request.Chat.IncludeUsage()
	h := a.w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	a.s.update(a.c, func(c *Call) { c.Status, c.Headers = http.StatusOK, time.Now() })
	a.w.WriteHeader(http.StatusOK)
	if err := http.NewResponseController(a.w).Flush(); err != nil {
		return
	}

	first := true
	// emit waits for the chunk's turn (FirstChunkDelay for the first, Interval after)
	// and writes it; it reports whether the stream goes on.
	emit := func(d deltaJSON, finish *string) bool {
		ch := chunkJSON{ID: a.id, Object: "chat.completion.chunk", Created: a.created, Model: a.model,
			SystemFingerprint: "fp_openaitest",
			Choices:           []choiceJSON{{Delta: d, Logprobs: jsonNull, FinishReason: finish}}}
		if includeUsage {
			ch.Usage = jsonNull
		}
		delay := rep.Interval
		if first {
			delay, first = rep.FirstChunkDelay, false
		}
		return a.wait(delay) && a.send("", mustJSON(ch))
	}
	quoted := func(s string) json.RawMessage { return mustJSON(s) }
	if len(rep.Content) > 0 || len(rep.ToolCalls) == 0 {
		if !emit(deltaJSON{Role: "assistant", Content: quoted(""), Refusal: jsonNull}, nil) {
			return
		}
	}
	for _, t := range rep.Content {
		if !emit(deltaJSON{Content: quoted(t)}, nil) {
			return
		}
	}
	for i, tc := range rep.ToolCalls {
		head := deltaJSON{ToolCalls: []toolCallDeltaJSON{{Index: i, ID: toolCallID(tc, i), Type: "function",
			Function: functionJSON{Name: tc.Name}}}}
		if i == 0 && len(rep.Content) == 0 {
			head.Role, head.Content, head.Refusal = "assistant", jsonNull, jsonNull
		}
		if !emit(head, nil) {
			return
		}
		for _, f := range fragments(tc) {
			if !emit(deltaJSON{ToolCalls: []toolCallDeltaJSON{{Index: i, Function: functionJSON{Arguments: f}}}}, nil) {
				return
			}
		}
	}
	switch {
	case rep.StreamError != nil:
		if a.wait(rep.Interval) {
			a.last(func() bool { return a.send("error", errorBody(*rep.StreamError)) })
		}
		return
	case rep.Reset:
		a.s.update(a.c, func(c *Call) { c.Completed = true })
		panic(http.ErrAbortHandler) // net/http closes the connection without ending the body
	case rep.Hang:
		<-a.ctx.Done()
		return
	}
	finish := a.finishReason()
	if !emit(deltaJSON{}, &finish) {
		return
	}
	if includeUsage && !rep.NoUsage {
		u := a.usage()
		b := mustJSON(chunkJSON{ID: a.id, Object: "chat.completion.chunk", Created: a.created, Model: a.model,
			SystemFingerprint: "fp_openaitest", Choices: []choiceJSON{},
			Usage: mustJSON(usageJSON{PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens, TotalTokens: u.PromptTokens + u.CompletionTokens})})
		if !a.wait(rep.Interval) || !a.send("", b) {
			return
		}
	}
	if rep.NoDone {
		a.s.update(a.c, func(c *Call) { c.Completed = true })
		return
	}
	a.last(func() bool { return a.sendRaw([]byte("data: [DONE]\n\n")) })
}

// last makes the reply's last write. The reply counts as completed from just before it:
// a client that has read the end may close the connection before the handler returns,
// and that is no client gone.
func (a *answer) last(write func() bool) {
	a.s.update(a.c, func(c *Call) {
		if !c.ClientGone {
			c.Completed = true
		}
	})
	if !write() {
		a.s.update(a.c, func(c *Call) { c.Completed = false })
		a.gone()
	}
}

func mustJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

// send writes one SSE event ("data: <json>\n\n", after "event: <name>\n" when named)
// and flushes it; it reports whether the write succeeded.
func (a *answer) send(event string, data []byte) bool {
	var b []byte
	if event != "" {
		b = append(b, "event: "+event+"\n"...)
	}
	b = append(b, "data: "...)
	b = append(b, data...)
	b = append(b, "\n\n"...)
	// The write's start is taken before the last look at the client: a write that
	// starts after the client was seen gone is either not made or counted.
	start := time.Now()
	if !a.reply.IgnoreDisconnect && a.ctx.Err() != nil {
		a.gone()
		return false
	}
	if !a.sendRaw(b) {
		a.gone()
		return false
	}
	a.s.update(a.c, func(c *Call) {
		c.Chunks++
		c.LastChunk = start
		if c.ClientGone && start.After(c.GoneAt) {
			c.ChunksAfterGone++
		}
	})
	return true
}

func (a *answer) sendRaw(b []byte) bool {
	if _, err := a.w.Write(b); err != nil {
		return false
	}
	return http.NewResponseController(a.w).Flush() == nil
}
