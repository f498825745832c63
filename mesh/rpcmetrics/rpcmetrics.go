package rpcmetrics

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Server is the standard gRPC server metrics of one server: grpc_server_started_total,
// grpc_server_handled_total, grpc_server_msg_received_total, grpc_server_msg_sent_total
// and grpc_server_handling_seconds. It is a prometheus.Collector; register it once.
type Server struct{ family }

// NewServer returns the server metrics, not registered.
func NewServer() *Server {
	s := &Server{}
	s.init("server",
		"Total number of RPCs started on the server.",
		"Total number of RPCs completed on the server, regardless of success or failure.",
		"Total number of RPC stream messages received on the server.",
		"Total number of gRPC stream messages sent by the server.",
		"Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.")
	return s
}

// UnaryServerInterceptor records every unary call the server handles.
func (s *Server) UnaryServerInterceptor() grpc.UnaryServerInterceptor { return s.WrapUnary(nil) }

// WrapUnary returns next with the metrics recorded around it, as one interceptor: what
// UnaryServerInterceptor records, for a chain that composes its layers itself (package
// mesh) rather than have grpc-go chain one more, which costs a closure per call. The
// metrics see the error next returns. A nil next calls the handler.
func (s *Server) WrapUnary(next grpc.UnaryServerInterceptor) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		start := time.Now()
		m := s.unary(info.FullMethod)
		m.started.Inc()
		m.received.Inc()
		if next != nil {
			resp, err = next(ctx, req, info, handler)
		} else {
			resp, err = handler(ctx, req)
		}
		m.PostMsgSend(resp, err, 0)
		m.PostCall(err, time.Since(start))
		return resp, err
	}
}

// StreamServerInterceptor records every streaming call the server handles.
func (s *Server) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return interceptors.StreamServerInterceptor(reportable{&s.family})
}

// Client is the standard gRPC client metrics: grpc_client_started_total,
// grpc_client_handled_total, grpc_client_msg_received_total, grpc_client_msg_sent_total
// and grpc_client_handling_seconds. One per process serves all its connections. It is a
// prometheus.Collector; register it once.
type Client struct{ family }

// NewClient returns the client metrics, not registered.
func NewClient() *Client {
	c := &Client{}
	c.init("client",
		"Total number of RPCs started on the client.",
		"Total number of RPCs completed by the client, regardless of success or failure.",
		"Total number of RPC stream messages received by the client.",
		"Total number of gRPC stream messages sent by the client.",
		"Histogram of response latency (seconds) of the gRPC until it is finished by the application.")
	return c
}

// UnaryClientInterceptor records every unary call made on the connection.
func (c *Client) UnaryClientInterceptor() grpc.UnaryClientInterceptor { return c.WrapUnary(nil) }

// WrapUnary returns next with the metrics recorded around it, as one interceptor (see
// Server.WrapUnary): one logical call as next makes it, retries included. A nil next
// calls the invoker.
func (c *Client) WrapUnary(next grpc.UnaryClientInterceptor) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		start := time.Now()
		m := c.unary(method)
		m.started.Inc()
		m.sent.Inc()
		var err error
		if next != nil {
			err = next(ctx, method, req, reply, cc, invoker, opts...)
		} else {
			err = invoker(ctx, method, req, reply, cc, opts...)
		}
		m.PostMsgReceive(reply, err, 0)
		m.PostCall(err, time.Since(start))
		return err
	}
}

// StreamClientInterceptor records every streaming call made on the connection.
func (c *Client) StreamClientInterceptor() grpc.StreamClientInterceptor {
	return interceptors.StreamClientInterceptor(reportable{&c.family})
}

// family is one side's five metric families and its per-method series.
type family struct {
	started, handled, received, sent *prometheus.CounterVec
	handling                         *prometheus.HistogramVec

	mu      sync.Mutex                      // serializes writers of methods
	methods atomic.Pointer[map[key]*series] // read without a lock; replaced on a new method
}

func (f *family) init(side, started, handled, received, sent, handling string) {
	labels := []string{"grpc_type", "grpc_service", "grpc_method"}
	newCounter := func(name, help string, labels []string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "grpc_" + side + "_" + name, Help: help}, labels)
	}
	f.started, f.handled, f.received, f.sent = newCounter("started_total", started, labels),
		newCounter("handled_total", handled, append(labels[:3:3], "grpc_code")),
		newCounter("msg_received_total", received, labels),
		newCounter("msg_sent_total", sent, labels)
	f.handling = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "grpc_" + side + "_handling_seconds", Help: handling, Buckets: prometheus.DefBuckets,
	}, labels)
	f.methods.Store(&map[key]*series{})
}

// Describe implements prometheus.Collector.
func (f *family) Describe(ch chan<- *prometheus.Desc) {
	f.started.Describe(ch)
	f.handled.Describe(ch)
	f.received.Describe(ch)
	f.sent.Describe(ch)
	f.handling.Describe(ch)
}

// Collect implements prometheus.Collector.
func (f *family) Collect(ch chan<- prometheus.Metric) {
	f.started.Collect(ch)
	f.handled.Collect(ch)
	f.received.Collect(ch)
	f.sent.Collect(ch)
	f.handling.Collect(ch)
}

// key names one method's series.
type key struct {
	typ             interceptors.GRPCType
	service, method string
}

// lookup returns the series of k, made on its first call.
func (f *family) lookup(k key) *series {
	if s, ok := (*f.methods.Load())[k]; ok {
		return s
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	old := *f.methods.Load()
	if s, ok := old[k]; ok {
		return s
	}
	lv := []string{string(k.typ), k.service, k.method}
	s := &series{
		f: f, labels: [3]string(lv),
		started:  f.started.WithLabelValues(lv...),
		received: f.received.WithLabelValues(lv...),
		sent:     f.sent.WithLabelValues(lv...),
		handling: f.handling.WithLabelValues(lv...),
	}
	next := make(map[key]*series, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[k] = s
	f.methods.Store(&next)
	return s
}

// unary returns the series of a unary call of fullMethod. (The interceptors package's
// unary interceptors, which streams use, read the clock four times per call; these read
// it twice and record the same.)
func (f *family) unary(fullMethod string) *series {
	m := interceptors.NewServerCallMeta(fullMethod, nil, nil) // splits the name; Typ is Unary
	return f.lookup(key{typ: interceptors.Unary, service: m.Service, method: m.Method})
}

// reportable gives every call its method's series as its reporter.
type reportable struct{ f *family }

func (r reportable) ServerReporter(ctx context.Context, m interceptors.CallMeta) (interceptors.Reporter, context.Context) {
	return r.start(ctx, m)
}

func (r reportable) ClientReporter(ctx context.Context, m interceptors.CallMeta) (interceptors.Reporter, context.Context) {
	return r.start(ctx, m)
}

func (r reportable) start(ctx context.Context, m interceptors.CallMeta) (interceptors.Reporter, context.Context) {
	s := r.f.lookup(key{typ: m.Typ, service: m.Service, method: m.Method})
	s.started.Inc()
	return s, ctx
}

// series is one method's series, and the reporter of each of its calls: what a call
// records depends only on its method and what happens to it.
type series struct {
	f                       *family
	labels                  [3]string // grpc_type, grpc_service, grpc_method
	started, received, sent prometheus.Counter
	handling                prometheus.Observer
	handled                 [codes.Unauthenticated + 1]atomic.Pointer[counterBox] // by code, made on first use
}

type counterBox struct{ prometheus.Counter }

// PostCall counts the call as handled with its code and observes its duration.
func (s *series) PostCall(err error, d time.Duration) {
	s.handledCounter(code(err)).Inc()
	s.handling.Observe(d.Seconds())
}

// PostMsgSend counts a message sent.
func (s *series) PostMsgSend(_ any, err error, _ time.Duration) {
	if err == nil {
		s.sent.Inc()
	}
}

// PostMsgReceive counts a message received.
func (s *series) PostMsgReceive(_ any, err error, _ time.Duration) {
	if err == nil {
		s.received.Inc()
	}
}

func (s *series) handledCounter(c codes.Code) prometheus.Counter {
	if int(c) >= len(s.handled) { // not a code of the gRPC spec: no cache slot
		return s.f.handled.WithLabelValues(s.labels[0], s.labels[1], s.labels[2], c.String())
	}
	if h := s.handled[c].Load(); h != nil {
		return h.Counter
	}
	h := &counterBox{s.f.handled.WithLabelValues(s.labels[0], s.labels[1], s.labels[2], c.String())}
	s.handled[c].Store(h) // a racing store stores the same series
	return h.Counter
}

// code is the status code of err, context errors mapped as grpc-go maps them (as the
// provider's FromError does).
func code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	if s, ok := status.FromError(err); ok {
		return s.Code()
	}
	return status.FromContextError(err).Code()
}
