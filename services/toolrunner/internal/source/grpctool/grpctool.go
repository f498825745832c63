package grpctool

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// Config names one gRPC tool server.
type Config struct {
	// Name is the source's name (the prefix of its tools' names); errors name it.
	// Required.
	Name string
	// Address is the server's gRPC target: host:port, or a target with a scheme
	// (dns:///tools.team.svc:7800, unix:///run/tools.sock). Required.
	Address string
	// DialOptions are added to the connection's options after a default of plaintext
	// transport credentials, so credentials among them win: toolrunner passes the mesh's
	// client chain (mesh.DialOptions, its retries off) and the source's TLS, when
	// configured.
	DialOptions []grpc.DialOption
}

// Options are the source's hooks; the zero value is usable.
type Options struct {
	// Late is called for each progress event that arrived after its call ended (the
	// node was cancelled or timed out); the event is dropped. nil counts nothing.
	Late func()
	// Logger receives what the source drops: tools with no name or an input schema that
	// is not JSON. nil logs nothing.
	Logger *slog.Logger
}

// Source is a gRPC tool server as a source.Source.
type Source struct {
	cfg    Config
	opts   Options
	conn   *grpc.ClientConn
	client toolv1.ToolServiceClient

	mu      sync.Mutex
	changed chan struct{}

	stop context.CancelFunc
	done chan struct{}
	late atomic.Int64
}

var _ source.Source = (*Source)(nil)

// Open returns the source of the server at cfg.Address and starts connecting to it. It
// fails, INVALID_ARGUMENT, only for a configuration that cannot be dialled; a server
// that is down makes List and Call fail later. ctx is not kept.
func Open(_ context.Context, cfg Config, opts Options) (*Source, error) {
	if cfg.Name == "" {
		return nil, status.Error(codes.InvalidArgument, "grpc tool source: name is empty")
	}
	if err := checkAddress(cfg.Address); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "grpc tool source %q: address %q: %v", cfg.Name, cfg.Address, err)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	dial := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, cfg.DialOptions...)
	conn, err := grpc.NewClient(cfg.Address, dial...)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "grpc tool source %q: address %q: %v", cfg.Name, cfg.Address, err)
	}
	ctx, stop := context.WithCancel(context.Background())
	s := &Source{cfg: cfg, opts: opts, conn: conn, client: toolv1.NewToolServiceClient(conn),
		changed: make(chan struct{}), stop: stop, done: make(chan struct{})}
	conn.Connect()
	go s.watch(ctx) //nolint:contextcheck // the watch lives as long as the source, not Open's ctx; Close ends it
	return s, nil
}

// checkAddress refuses an address that is empty or, without a scheme, not host:port.
func checkAddress(addr string) error {
	if strings.TrimSpace(addr) == "" {
		return errors.New("empty")
	}
	if strings.Contains(addr, "://") || strings.HasPrefix(addr, "unix:") {
		return nil // grpc.NewClient judges a target with a scheme
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("not host:port: %w", err)
	}
	if n, err := strconv.Atoi(port); err != nil || n <= 0 || n > 65535 {
		return fmt.Errorf("port %q is not a number from 1 to 65535", port)
	}
	if host == "" {
		return errors.New("no host")
	}
	return nil
}

// watch closes the changed channel each time the connection becomes ready.
func (s *Source) watch(ctx context.Context) {
	defer close(s.done)
	state := s.conn.GetState()
	if state == connectivity.Ready {
		s.signal() // ready before the watch began
	}
	for {
		if !s.conn.WaitForStateChange(ctx, state) {
			return // closed
		}
		prev := state
		state = s.conn.GetState()
		if state == connectivity.Ready && prev != connectivity.Ready {
			s.signal()
		}
	}
}

// signal closes the current changed channel and makes the next.
func (s *Source) signal() {
	s.mu.Lock()
	defer s.mu.Unlock()
	close(s.changed)
	s.changed = make(chan struct{})
}

// Changed is closed when the connection has become ready since the last Changed: the
// server came up or restarted, and its tools may differ.
func (s *Source) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

// Close closes the connection; calls in flight fail CANCELLED.
func (s *Source) Close() error {
	s.stop()
	err := s.conn.Close()
	<-s.done
	return err
}

// LateEvents returns how many progress events arrived after their call ended.
func (s *Source) LateEvents() int64 { return s.late.Load() }

// List asks the server for its tools. A tool without a name or with an input schema
// that is not a JSON object is left out and logged.
func (s *Source) List(ctx context.Context) ([]source.Tool, error) {
	res, err := s.client.ListTools(ctx, &toolv1.ListToolsRequest{})
	if err != nil {
		return nil, s.wrap(ctx, "ListTools", err)
	}
	tools := make([]source.Tool, 0, len(res.GetTools()))
	for _, t := range res.GetTools() {
		if t.GetName() == "" {
			s.opts.Logger.Warn("grpc tool source: a tool without a name, left out", "source", s.cfg.Name)
			continue
		}
		var schema json.RawMessage
		if js := strings.TrimSpace(t.GetInputSchemaJson()); js != "" {
			if js[0] != '{' || !json.Valid([]byte(js)) {
				s.opts.Logger.Warn("grpc tool source: input_schema_json is not a JSON object, tool left out",
					"source", s.cfg.Name, "tool", t.GetName())
				continue
			}
			schema = json.RawMessage(js)
		}
		tools = append(tools, source.Tool{Name: t.GetName(), Description: t.GetDescription(),
			InputSchema: schema, Hints: hints(t.GetSideEffects())})
	}
	return tools, nil
}

// hints translates ToolService's side_effects; unspecified says nothing.
func hints(e toolv1.SideEffects) source.Hints {
	yes, no := true, false
	switch e {
	case toolv1.SideEffects_SIDE_EFFECTS_NONE:
		return source.Hints{ReadOnly: &yes, Destructive: &no, Idempotent: &yes}
	case toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT:
		return source.Hints{ReadOnly: &no, Idempotent: &yes}
	case toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE:
		return source.Hints{ReadOnly: &no, Idempotent: &no}
	default:
		return source.Hints{}
	}
}

// Call runs one tool. ctx's deadline, shortened to call.Meta.Deadline when that is
// earlier, is the call's gRPC deadline; cancelling ctx resets the stream.
func (s *Source) Call(ctx context.Context, call source.Call, progress func(*meshv1.Progress)) (source.Result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if dl := call.Meta.Deadline; !dl.IsZero() {
		ctx, cancel = context.WithDeadline(ctx, dl)
		defer cancel()
	}
	ctx = outgoing(ctx, call.Meta)

	args := call.Args
	if len(bytes.TrimSpace(args)) == 0 {
		args = json.RawMessage("{}")
	}
	stream, err := s.client.CallTool(ctx, &toolv1.CallToolRequest{Name: call.Tool, ArgumentsJson: string(args)})
	if err != nil {
		return source.Result{}, s.wrap(ctx, "CallTool "+call.Tool, err)
	}
	for {
		ev, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return source.Result{}, status.Errorf(codes.Internal, "tool source %q: tool %q: the stream ended without a result", s.cfg.Name, call.Tool)
		}
		if err != nil {
			return source.Result{}, s.wrap(ctx, "CallTool "+call.Tool, err)
		}
		if ctx.Err() != nil {
			// gRPC still hands over what it had buffered when ctx ended; the call is over.
			if ev.GetProgress() != nil {
				s.dropLate()
			}
			return source.Result{}, s.wrap(ctx, "CallTool "+call.Tool, status.FromContextError(ctx.Err()).Err())
		}
		switch e := ev.GetEvent().(type) {
		case *toolv1.CallToolResponse_Progress:
			progress(e.Progress)
		case *toolv1.CallToolResponse_Result:
			return s.result(call.Tool, e.Result)
		default:
			return source.Result{}, status.Errorf(codes.Internal, "tool source %q: tool %q sent an empty event", s.cfg.Name, call.Tool)
		}
	}
}

// result converts a CallToolResult.
func (s *Source) result(tool string, r *toolv1.CallToolResult) (source.Result, error) {
	res := source.Result{IsError: r.GetIsError(), Text: r.GetErrorText()}
	if out := strings.TrimSpace(r.GetOutputJson()); out != "" {
		if !json.Valid([]byte(out)) {
			return source.Result{}, status.Errorf(codes.Internal, "tool source %q: tool %q: output_json is not JSON", s.cfg.Name, tool)
		}
		res.Output = json.RawMessage(out)
	}
	return res, nil
}

func (s *Source) dropLate() {
	s.late.Add(1)
	if s.opts.Late != nil {
		s.opts.Late()
	}
}

// outgoing puts curfew's metadata of m on ctx's outgoing metadata, replacing what the
// caller set for the same keys, then the identity and deadline of ctx (md.AppendOutgoing:
// tenant, and run, node and deadline where m left them empty). mesh's client retry layer
// keeps a retry-id and attempt it finds, so the server sees m's.
func outgoing(ctx context.Context, m source.Meta) context.Context {
	out, _ := metadata.FromOutgoingContext(ctx) // a copy
	if out == nil {
		out = metadata.MD{}
	}
	set := func(k, v string) {
		if v != "" {
			out.Set(k, v)
		}
	}
	set(md.RunID, m.RunID)
	set(md.NodeID, m.NodeID)
	set(md.RetryID, m.RetryID)
	if m.Attempt > 0 {
		set(md.Attempt, strconv.Itoa(m.Attempt))
	}
	set(md.IdempotencyKey, m.IdempotencyKey)
	if m.Hedge {
		set(md.Hedge, md.HedgeBackup)
	} else {
		out.Delete(md.Hedge)
	}
	if dl, ok := ctx.Deadline(); ok {
		set(md.Deadline, strconv.FormatInt(dl.UnixMilli(), 10))
	}
	return md.AppendOutgoing(metadata.NewOutgoingContext(ctx, out))
}

// wrap names the source in err's status. A call cut short by ctx reports ctx's end;
// a message over the limit also wraps source.ErrTooLarge.
func (s *Source) wrap(ctx context.Context, what string, err error) error {
	st, _ := status.FromError(err)
	if ctx.Err() != nil && (st.Code() == codes.Canceled || st.Code() == codes.DeadlineExceeded) {
		st = status.FromContextError(ctx.Err())
	}
	p := st.Proto()
	p.Message = fmt.Sprintf("tool source %q (%s): %s: %s", s.cfg.Name, s.cfg.Address, what, p.GetMessage())
	out := status.FromProto(p).Err()
	if st.Code() == codes.ResourceExhausted && strings.Contains(st.Message(), "larger than max") {
		return &tooLarge{err: out}
	}
	return out
}

// tooLarge is a RESOURCE_EXHAUSTED status that also matches source.ErrTooLarge.
type tooLarge struct{ err error }

func (e *tooLarge) Error() string              { return e.err.Error() }
func (e *tooLarge) GRPCStatus() *status.Status { return status.Convert(e.err) }
func (e *tooLarge) Is(target error) bool       { return target == source.ErrTooLarge }
