package mesh_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"testing"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testgrpc "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// testService answers every kind of call; a request whose payload body is "fail" (or,
// streaming, whose first message is) fails with NOT_FOUND.
type testService struct {
	testgrpc.UnimplementedTestServiceServer
}

func (testService) UnaryCall(_ context.Context, in *testgrpc.SimpleRequest) (*testgrpc.SimpleResponse, error) {
	if string(in.GetPayload().GetBody()) == "fail" {
		return nil, status.Error(codes.NotFound, "no such thing")
	}
	return &testgrpc.SimpleResponse{}, nil
}

func (testService) StreamingOutputCall(in *testgrpc.StreamingOutputCallRequest, ss testgrpc.TestService_StreamingOutputCallServer) error {
	if string(in.GetPayload().GetBody()) == "fail" {
		return status.Error(codes.NotFound, "no such thing")
	}
	for range 3 {
		if err := ss.Send(&testgrpc.StreamingOutputCallResponse{}); err != nil {
			return err
		}
	}
	return nil
}

func (testService) StreamingInputCall(ss testgrpc.TestService_StreamingInputCallServer) error {
	for {
		in, err := ss.Recv()
		if errors.Is(err, io.EOF) {
			return ss.SendAndClose(&testgrpc.StreamingInputCallResponse{})
		}
		if err != nil {
			return err
		}
		if string(in.GetPayload().GetBody()) == "fail" {
			return status.Error(codes.NotFound, "no such thing")
		}
	}
}

func (testService) FullDuplexCall(ss testgrpc.TestService_FullDuplexCallServer) error {
	for {
		_, err := ss.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := ss.Send(&testgrpc.StreamingOutputCallResponse{}); err != nil {
			return err
		}
	}
}

// TestMetricsSameAsProvider runs the same calls through go-grpc-middleware's Prometheus
// provider, installed around the mesh chain on both sides, and through the mesh chain's
// own metrics, and wants the same metric families: names, help, types, label sets,
// counter values and histogram sample counts. The chain's metrics are the provider's,
// configured as the services run them, and see each call as it does.
func TestMetricsSameAsProvider(t *testing.T) {
	ours, theirs := prometheus.NewRegistry(), prometheus.NewRegistry()
	srv, cli := mesh.NewServerMetrics(ours), mesh.NewClientMetrics(ours)
	psrv := grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram())
	pcli := grpcprom.NewClientMetrics(grpcprom.WithClientHandlingTimeHistogram())
	theirs.MustRegister(psrv, pcli)

	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(append([]grpc.ServerOption{
		grpc.ChainUnaryInterceptor(psrv.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(psrv.StreamServerInterceptor())},
		mesh.ServerOptions(mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler), Metrics: srv})...)...)
	testgrpc.RegisterTestServiceServer(s, testService{})
	served := make(chan struct{})
	go func() { defer close(served); _ = s.Serve(lis) }()
	defer func() { s.Stop(); <-served }()
	cc, err := grpc.NewClient(lis.Addr().String(), append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(pcli.UnaryClientInterceptor()),
		grpc.WithChainStreamInterceptor(pcli.StreamClientInterceptor())},
		mesh.DialOptions(mesh.ClientConfig{Retry: retry.Config{Target: "test", Default: retry.Policy{Disabled: true}}, Metrics: cli})...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cc.Close() }()
	c := testgrpc.NewTestServiceClient(cc)
	ctx := t.Context()
	body := func(s string) *testgrpc.Payload { return &testgrpc.Payload{Body: []byte(s)} }

	for _, b := range []string{"ok", "ok", "fail"} {
		_, err := c.UnaryCall(ctx, &testgrpc.SimpleRequest{Payload: body(b)})
		if (b == "fail") != (status.Code(err) == codes.NotFound) {
			t.Fatalf("UnaryCall(%s): %v", b, err)
		}
	}
	for _, b := range []string{"ok", "fail"} {
		st, err := c.StreamingOutputCall(ctx, &testgrpc.StreamingOutputCallRequest{Payload: body(b)})
		if err != nil {
			t.Fatal(err)
		}
		for {
			if _, err = st.Recv(); err != nil {
				break
			}
		}
		if !errors.Is(err, io.EOF) && status.Code(err) != codes.NotFound {
			t.Fatalf("StreamingOutputCall(%s): %v", b, err)
		}
	}
	for _, msgs := range [][]string{{"ok", "ok"}, {"ok", "fail"}} {
		st, err := c.StreamingInputCall(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range msgs {
			if err := st.Send(&testgrpc.StreamingInputCallRequest{Payload: body(b)}); err != nil && !errors.Is(err, io.EOF) {
				t.Fatal(err)
			}
		}
		_, _ = st.CloseAndRecv()
	}
	st, err := c.FullDuplexCall(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := st.Send(&testgrpc.StreamingOutputCallRequest{}); err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	_ = st.CloseSend()
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("FullDuplexCall: %v", err)
	}
	// A call cancelled by its client before it is sent.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := c.UnaryCall(cctx, &testgrpc.SimpleRequest{}); status.Code(err) != codes.Canceled {
		t.Fatalf("cancelled UnaryCall: %v", err)
	}
	s.GracefulStop() // every server-side call has been recorded

	got, want := dump(t, ours, "grpc_"), dump(t, theirs, "grpc_")
	if len(want) == 0 {
		t.Fatal("the provider recorded nothing")
	}
	if !slices.Equal(got, want) {
		t.Errorf("series differ\nours:\n  %s\nprovider:\n  %s", strings.Join(got, "\n  "), strings.Join(want, "\n  "))
	}
	for _, name := range []string{"grpc_server_handled_total", "grpc_client_handled_total", "grpc_server_msg_received_total", "grpc_client_msg_sent_total"} {
		if !slices.ContainsFunc(want, func(s string) bool { return strings.HasPrefix(s, name) }) {
			t.Errorf("no %s recorded; the test calls do not exercise it", name)
		}
	}
}

// dump renders reg's families whose names begin with prefix, one line per series
// (histograms by sample count: their sums are durations and differ between any two
// recorders).
func dump(t *testing.T, reg *prometheus.Registry, prefix string) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), prefix) {
			continue
		}
		out = append(out, mf.GetName()+" "+mf.GetType().String()+" "+mf.GetHelp())
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			line := mf.GetName() + "{" + strings.Join(labels, ",") + "} "
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				line += prometheusFloat(m.GetCounter().GetValue())
			case dto.MetricType_HISTOGRAM:
				line += "count=" + prometheusFloat(float64(m.GetHistogram().GetSampleCount()))
				for _, b := range m.GetHistogram().GetBucket() {
					line += " le=" + prometheusFloat(b.GetUpperBound())
				}
			default:
				t.Fatalf("unexpected type %s of %s", mf.GetType(), mf.GetName())
			}
			out = append(out, line)
		}
	}
	return out
}

func prometheusFloat(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }
