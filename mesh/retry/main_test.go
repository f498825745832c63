package retry_test

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	listNodes   = "/curfew.mesh.v1.NodeReportService/ListNodes"
	cancelNodes = "/curfew.mesh.v1.NodeReportService/CancelNodes"
	execute     = "/curfew.toolrunner.v1.ToolRunnerService/Execute"
)

// seen is what the server saw of one attempt.
type seen struct {
	method   string
	retryIDs []string // every curfew-retry-id value (one expected)
	attempts []string // every curfew-attempt value (one expected)
	key      string
	hedges   []string                     // every curfew-hedge value
	req      *toolrunnerv1.ExecuteRequest // Execute only
}

func (s seen) retryID() string {
	if len(s.retryIDs) == 0 {
		return ""
	}
	return s.retryIDs[0]
}

func (s seen) attempt() string {
	if len(s.attempts) == 0 {
		return ""
	}
	return s.attempts[0]
}

// recorder records the attempts a test service sees, numbered from 1 in arrival order.
type recorder struct {
	mu   sync.Mutex
	seen []seen
}

func (r *recorder) record(ctx context.Context, method string, req *toolrunnerv1.ExecuteRequest) int {
	in, _ := metadata.FromIncomingContext(ctx)
	s := seen{method: method, retryIDs: in.Get(md.RetryID), attempts: in.Get(md.Attempt), hedges: in.Get(md.Hedge), req: req}
	if k := in.Get(md.IdempotencyKey); len(k) > 0 {
		s.key = k[0]
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, s)
	return len(r.seen)
}

func (r *recorder) all() []seen {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]seen(nil), r.seen...)
}

// nodes is a NodeReportService whose ListNodes and CancelNodes fail attempt n (the n-th
// call the service sees, from 1) with fail(ctx, n) when it returns an error.
type nodes struct {
	meshv1.UnimplementedNodeReportServiceServer
	recorder
	fail func(ctx context.Context, n int) error
}

func (s *nodes) ListNodes(ctx context.Context, req *meshv1.ListNodesRequest) (*meshv1.ListNodesResponse, error) {
	n := s.record(ctx, listNodes, nil)
	if s.fail != nil {
		if err := s.fail(ctx, n); err != nil {
			return nil, err
		}
	}
	return &meshv1.ListNodesResponse{Settled: true, Nodes: []*meshv1.Node{{Id: req.GetRunId()}}}, nil
}

func (s *nodes) CancelNodes(ctx context.Context, _ *meshv1.CancelNodesRequest) (*meshv1.CancelNodesResponse, error) {
	n := s.record(ctx, cancelNodes, nil)
	if s.fail != nil {
		if err := s.fail(ctx, n); err != nil {
			return nil, err
		}
	}
	return &meshv1.CancelNodesResponse{Cancelled: 1}, nil
}

// tools is a ToolRunnerService whose Execute runs behave(ss, n) for attempt n.
type tools struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	recorder
	behave func(ss grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse], req *toolrunnerv1.ExecuteRequest, n int) error
}

func (s *tools) Execute(req *toolrunnerv1.ExecuteRequest, ss grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]) error {
	n := s.record(ss.Context(), execute, req)
	return s.behave(ss, req, n)
}

// serve starts a real gRPC server with the mesh chain serving svcs and returns its address.
func serve(t *testing.T, n *nodes, tr *tools) string {
	t.Helper()
	conn := meshtest.Serve(t, mesh.ServerConfig{Logger: quiet()}, func(s *grpc.Server) {
		if n != nil {
			meshv1.RegisterNodeReportServiceServer(s, n)
		}
		if tr != nil {
			toolrunnerv1.RegisterToolRunnerServiceServer(s, tr)
		}
	})
	return conn.Target()
}

// dial returns a client with the mesh client chain and cfg's retries; t.Cleanup closes it.
func dial(t *testing.T, addr string, cfg retry.Config) *grpc.ClientConn {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = quiet()
	}
	opts := append(mesh.DialOptions(mesh.ClientConfig{Retry: cfg}), grpc.WithTransportCredentials(insecure.NewCredentials()))
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// sleeper records the waits the retry layer asks for and returns at once.
type sleeper struct {
	mu sync.Mutex
	d  []time.Duration
}

func (s *sleeper) Sleep(ctx context.Context, d time.Duration) error {
	s.mu.Lock()
	s.d = append(s.d, d)
	s.mu.Unlock()
	return ctx.Err()
}

func (s *sleeper) waits() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Duration(nil), s.d...)
}

func constRand(v float64) func() float64 { return func() float64 { return v } }

// fixedClock is a settable clock.
type fixedClock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *fixedClock { return &fixedClock{t: time.Unix(1_700_000_000, 0)} }

func (c *fixedClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fixedClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// metric returns the value of the series of name whose labels include want: a counter's or
// gauge's value, a histogram's sample count. Absent series read as 0.
func metric(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	v, _ := metricSum(t, reg, name, want)
	return v
}

// metricSum is metric, also returning a histogram's sample sum.
func metricSum(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) (value, sum float64) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if !hasLabels(m, want) {
				continue
			}
			switch {
			case m.GetCounter() != nil:
				value += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				value += m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				value += float64(m.GetHistogram().GetSampleCount())
				sum += m.GetHistogram().GetSampleSum()
			}
		}
	}
	return value, sum
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}
