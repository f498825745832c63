package mcp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/modelcontextprotocol/go-sdk/jsonrpc"
	sdk "github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// DefaultMaxMessageBytes is Options.MaxMessageBytes when it is zero: 4 MiB.
const DefaultMaxMessageBytes = 4 << 20

// The defaults of Options.MinRestartBackoff and Options.MaxRestartBackoff.
const (
	DefaultMinRestartBackoff = 200 * time.Millisecond
	DefaultMaxRestartBackoff = 30 * time.Second
)

// connectTimeout bounds one attempt to start a session (process start and MCP handshake,
// or the HTTP handshake).
const connectTimeout = 15 * time.Second

// Options tune a Source. The zero value is ready to use.
type Options struct {
	// MaxMessageBytes is the largest message the source accepts from its server (a
	// stdio line, an SSE event, a JSON response body); 0 means DefaultMaxMessageBytes.
	MaxMessageBytes int
	// Late, when set, is called once for every message the source drops because the
	// call it belongs to has returned (a progress report after the call ended).
	Late func()
	// Logger receives the source's reconnects and the stderr of a stdio server (at
	// debug level); nil means slog.Default().
	Logger *slog.Logger
	// MinRestartBackoff and MaxRestartBackoff bound the exponential backoff between
	// attempts to reconnect (restart a stdio process); 0 means DefaultMinRestartBackoff
	// and DefaultMaxRestartBackoff. The backoff starts again from the minimum once a
	// session has lasted MaxRestartBackoff.
	MinRestartBackoff time.Duration
	MaxRestartBackoff time.Duration
}

func (o Options) withDefaults() Options {
	if o.MaxMessageBytes <= 0 {
		o.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.MinRestartBackoff <= 0 {
		o.MinRestartBackoff = DefaultMinRestartBackoff
	}
	if o.MaxRestartBackoff <= 0 {
		o.MaxRestartBackoff = DefaultMaxRestartBackoff
	}
	o.MaxRestartBackoff = max(o.MaxRestartBackoff, o.MinRestartBackoff)
	return o
}

// Source is an MCP server as a source.Source. Its methods are safe for concurrent use.
type Source struct {
	name    string
	opts    Options
	client  *sdk.Client
	connect func(ctx context.Context) (*session, error)

	life context.Context // ends with Close
	stop context.CancelFunc
	wg   sync.WaitGroup

	mu      sync.Mutex
	sess    *session // nil while down
	downErr error    // why sess is nil
	changed chan struct{}
	closed  bool

	tokens  atomic.Uint64
	pending sync.Map // progress token -> *pending

	// onClose runs after the last session ended (HTTP: drop idle connections).
	onClose func()
}

var _ source.Source = (*Source)(nil)

// session is one MCP session with the server.
type session struct {
	cs *sdk.ClientSession
	// pid is a stdio server's process id (0 over HTTP).
	pid int
	// tooLarge is set when the server sent a message over the limit on this session's
	// stream (stdio); HTTP marks the call instead (see callFlag).
	tooLarge atomic.Bool
	// done is closed when the session has ended and its process, if any, is reaped;
	// err then says why it ended.
	done chan struct{}
	err  error
	// end ends the session (and stops its process) and waits for done.
	end func()
}

// tokenPrefix starts every progress token the source sends, so that a report for a
// call that has returned is recognised as late rather than foreign.
const tokenPrefix = "curfew-"

// pending is a call in flight, as its progress reports see it.
type pending struct {
	mu       sync.Mutex
	progress func(*meshv1.Progress)
	returned bool
}

func newSource(name string, opts Options, connect func(*Source) func(context.Context) (*session, error)) *Source {
	s := &Source{name: name, opts: opts.withDefaults(), changed: make(chan struct{})}
	s.life, s.stop = context.WithCancel(context.Background())
	s.client = sdk.NewClient(&sdk.Implementation{Name: "curfew-toolrunner", Version: "1"}, &sdk.ClientOptions{
		Logger:                      s.opts.Logger,
		ProgressNotificationHandler: s.onProgress,
		ToolListChangedHandler:      func(context.Context, *sdk.ToolListChangedRequest) { s.signalChanged() },
		Capabilities:                &sdk.ClientCapabilities{},
	})
	s.connect = connect(s)
	return s
}

// start makes the first attempt to connect, synchronously so that a server that is up
// is usable when Open returns, and then supervises the session.
func (s *Source) start(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	sess, err := s.connect(cctx)
	cancel()
	s.mu.Lock()
	s.sess, s.downErr = sess, err
	s.mu.Unlock()
	if err != nil {
		s.opts.Logger.Warn("mcp source down", "source", s.name, "err", err)
	}
	s.wg.Add(1)
	go s.supervise(sess) //nolint:contextcheck // the supervisor outlives Open's ctx by design: it lives until Close
}

// supervise waits for the session to end and reconnects with backoff, until Close.
func (s *Source) supervise(sess *session) {
	defer s.wg.Done()
	backoff := s.opts.MinRestartBackoff
	for {
		if sess != nil {
			began := time.Now()
			select {
			case <-sess.done:
			case <-s.life.Done():
				return
			}
			s.setDown(sess, sess.err)
			s.opts.Logger.Warn("mcp session ended", "source", s.name, "err", sess.err)
			if time.Since(began) >= s.opts.MaxRestartBackoff {
				backoff = s.opts.MinRestartBackoff
			}
		}
		// Full jitter on the upper half keeps restarts of many sources apart.
		wait := backoff/2 + rand.N(backoff/2+1) //nolint:gosec // jitter, not secrets
		select {
		case <-time.After(wait):
		case <-s.life.Done():
			return
		}
		backoff = min(backoff*2, s.opts.MaxRestartBackoff)
		ctx, cancel := context.WithTimeout(s.life, connectTimeout)
		next, err := s.connect(ctx)
		cancel()
		if err != nil {
			sess = nil
			s.setDown(nil, err)
			s.opts.Logger.Debug("mcp reconnect failed", "source", s.name, "err", err)
			continue
		}
		if !s.setUp(next) {
			next.end()
			return
		}
		s.opts.Logger.Info("mcp source reconnected", "source", s.name)
		sess = next
		s.signalChanged()
	}
}

func (s *Source) setDown(old *session, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sess == old {
		s.sess, s.downErr = nil, err
	}
}

// setUp installs sess as the current session; false once the source is closed.
func (s *Source) setUp(sess *session) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.sess, s.downErr = sess, nil
	return true
}

func (s *Source) signalChanged() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	close(s.changed)
	s.changed = make(chan struct{})
}

// Changed implements source.Source: closed when the server says its tools changed and
// after every reconnect.
func (s *Source) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

// current returns the session, or UNAVAILABLE saying why there is none.
func (s *Source) current() (*session, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return nil, status.Errorf(codes.Unavailable, "mcp source %q: closed", s.name)
	case s.sess == nil:
		return nil, status.Errorf(codes.Unavailable, "mcp source %q: unavailable: %v", s.name, s.downErr)
	}
	return s.sess, nil
}

// Close implements source.Source: it ends the session, stops a stdio server's process
// and waits for it to be reaped.
func (s *Source) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	sess := s.sess
	s.sess, s.downErr = nil, errors.New("closed")
	s.mu.Unlock()
	s.stop()
	s.wg.Wait()
	if sess != nil {
		sess.end()
	}
	if s.onClose != nil {
		s.onClose()
	}
	return nil
}

// List implements source.Source.
func (s *Source) List(ctx context.Context) ([]source.Tool, error) {
	sess, err := s.current()
	if err != nil {
		return nil, err
	}
	var out []source.Tool
	params := &sdk.ListToolsParams{}
	for {
		res, err := sess.cs.ListTools(ctx, params)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, s.failure(ctx, sess, nil, "tools/list", err)
		}
		for _, t := range res.Tools {
			out = append(out, toTool(t))
		}
		if res.NextCursor == "" || res.NextCursor == params.Cursor {
			return out, nil
		}
		params = &sdk.ListToolsParams{Cursor: res.NextCursor}
	}
}

func toTool(t *sdk.Tool) source.Tool {
	out := source.Tool{Name: t.Name, Description: t.Description}
	if t.InputSchema != nil {
		if raw, err := json.Marshal(t.InputSchema); err == nil && string(raw) != "null" {
			out.InputSchema = raw
		}
	}
	if a := t.Annotations; a != nil {
		// The SDK decodes readOnlyHint and idempotentHint into plain bools, so false
		// (the protocol's default) cannot be told from not said: only true is a claim.
		if a.ReadOnlyHint {
			out.Hints.ReadOnly = new(true)
		}
		if a.IdempotentHint {
			out.Hints.Idempotent = new(true)
		}
		out.Hints.Destructive = a.DestructiveHint
		out.Hints.OpenWorld = a.OpenWorldHint
	}
	return out
}

// callFlagKey carries a call's *atomic.Bool into the HTTP transport, which sets it when
// a response to the call is over the limit.
type callFlagKey struct{}

func callFlag(ctx context.Context) *atomic.Bool {
	f, _ := ctx.Value(callFlagKey{}).(*atomic.Bool)
	return f
}

// Call implements source.Source.
func (s *Source) Call(ctx context.Context, call source.Call, progress func(*meshv1.Progress)) (source.Result, error) {
	sess, err := s.current()
	if err != nil {
		return source.Result{}, err
	}
	token := tokenPrefix + strconv.FormatUint(s.tokens.Add(1), 10)
	p := &pending{progress: progress}
	s.pending.Store(token, p)
	defer func() {
		// After this, no report reaches progress: onProgress holds p.mu to deliver.
		p.mu.Lock()
		p.returned = true
		p.mu.Unlock()
		s.pending.Delete(token)
	}()

	var args any = map[string]any{}
	if len(call.Args) > 0 {
		args = call.Args
	}
	params := &sdk.CallToolParams{Name: call.Tool, Arguments: args, Meta: sdk.Meta(call.Meta.MCPMeta(time.Now()))}
	params.SetProgressToken(token)
	tooLarge := new(atomic.Bool)
	res, err := sess.cs.CallTool(context.WithValue(ctx, callFlagKey{}, tooLarge), params)
	if ctx.Err() != nil {
		return source.Result{}, ctx.Err()
	}
	if err != nil {
		return source.Result{}, s.failure(ctx, sess, tooLarge, "tool "+strconv.Quote(call.Tool), err)
	}
	return toResult(res)
}

func toResult(res *sdk.CallToolResult) (source.Result, error) {
	var out source.Result
	var err error
	if res.StructuredContent != nil {
		out.Output, err = json.Marshal(res.StructuredContent)
	} else {
		content := res.Content
		if content == nil {
			content = []sdk.Content{}
		}
		out.Output, err = json.Marshal(content)
	}
	if err != nil {
		return source.Result{}, status.Errorf(codes.Internal, "mcp: encoding the result: %v", err)
	}
	if res.IsError {
		out.IsError = true
		var text []string
		for _, c := range res.Content {
			if t, ok := c.(*sdk.TextContent); ok {
				text = append(text, t.Text)
			}
		}
		out.Text = strings.Join(text, "\n")
	}
	return out, nil
}

// failure turns a failed request into a gRPC status naming the source: the server's
// JSON-RPC error keeps its meaning, a message over the limit wraps source.ErrTooLarge,
// anything else is the session failing (UNAVAILABLE), with the reason the session ended
// when it ends meanwhile.
func (s *Source) failure(ctx context.Context, sess *session, tooLarge *atomic.Bool, what string, err error) error {
	if sess.tooLarge.Load() || (tooLarge != nil && tooLarge.Load()) || errors.Is(err, source.ErrTooLarge) {
		return &statusError{
			st:  status.Newf(codes.ResourceExhausted, "mcp source %q: %s: the server sent a message over %d bytes", s.name, what, s.opts.MaxMessageBytes),
			err: source.ErrTooLarge,
		}
	}
	var werr *jsonrpc.Error
	if errors.As(err, &werr) {
		code := codes.Internal
		switch werr.Code {
		case jsonrpc.CodeInvalidParams:
			code = codes.InvalidArgument
		case jsonrpc.CodeMethodNotFound:
			code = codes.Unimplemented
		}
		return status.Errorf(code, "mcp source %q: %s: %s", s.name, what, werr.Message)
	}
	// The session usually ends right after a request fails for want of it; its reason
	// (a process's exit status) says more than "connection closed".
	select {
	case <-sess.done:
		err = fmt.Errorf("%w (%w)", err, sess.err)
	case <-time.After(200 * time.Millisecond):
	case <-ctx.Done():
	}
	return &statusError{st: status.Newf(codes.Unavailable, "mcp source %q: %s: %v", s.name, what, err), err: err}
}

// statusError is a gRPC status that also wraps the error it stands for, so callers can
// both read its code and test it with errors.Is.
type statusError struct {
	st  *status.Status
	err error
}

func (e *statusError) Error() string              { return e.st.Err().Error() }
func (e *statusError) GRPCStatus() *status.Status { return e.st }
func (e *statusError) Unwrap() error              { return e.err }

// onProgress routes a progress report to its call, or counts it as late.
func (s *Source) onProgress(_ context.Context, req *sdk.ProgressNotificationClientRequest) {
	token, ok := req.Params.ProgressToken.(string)
	if !ok || !strings.HasPrefix(token, tokenPrefix) {
		return // not a token of ours
	}
	v, ok := s.pending.Load(token)
	if !ok {
		s.late()
		return
	}
	p := v.(*pending)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.returned {
		s.late()
		return
	}
	if p.progress == nil {
		return
	}
	p.progress(&meshv1.Progress{Progress: req.Params.Progress, Total: req.Params.Total, Message: req.Params.Message})
}

func (s *Source) late() {
	if s.opts.Late != nil {
		s.opts.Late()
	}
}
