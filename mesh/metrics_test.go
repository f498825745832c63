package mesh_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// metricsPair is a server with the chain's metrics and a client connection with the
// client chain's metrics, each on its own registry (two processes), on loopback.
func metricsPair(t *testing.T, log *slog.Logger, fn func(context.Context) error) (srvReg, cliReg *prometheus.Registry, cc *grpc.ClientConn) {
	t.Helper()
	srvReg, cliReg = prometheus.NewRegistry(), prometheus.NewRegistry()
	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &probe{fn: fn}
	srv := grpc.NewServer(append(mesh.ServerOptions(mesh.ServerConfig{Deadline: testPolicy, Logger: log, Metrics: mesh.NewServerMetrics(srvReg)}),
		grpc.WaitForHandlers(true))...)
	meshv1.RegisterNodeReportServiceServer(srv, p)
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(lis) }()
	ccfg := mesh.ClientConfig{Retry: retry.Config{Target: "probe", Default: retry.Policy{Disabled: true}}, Metrics: mesh.NewClientMetrics(cliReg)}
	cc, err = grpc.NewClient(lis.Addr().String(), append(mesh.DialOptions(ccfg), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close(); srv.Stop(); <-served })
	return srvReg, cliReg, cc
}

// metric returns the one series of name in reg whose labels include match.
func metric(t *testing.T, reg *prometheus.Registry, name string, match map[string]string) *dto.Metric {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			for k, v := range match {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue series
				}
			}
			return m
		}
	}
	t.Fatalf("no series %s%v", name, match)
	return nil
}

// The standard gRPC metrics count each call once on each side with the code the caller
// received, and the deadline slack on arrival is the time the caller gave, observed
// after the chain's default and cap.
func TestChainMetrics(t *testing.T) {
	srvReg, cliReg, cc := metricsPair(t, slog.New(slog.DiscardHandler), func(ctx context.Context) error {
		switch md.IdentityFrom(ctx).NodeID {
		case "fail":
			return status.Error(codes.NotFound, "no such node")
		case "panic":
			panic("handler bug")
		}
		return nil
	})
	call := func(timeout time.Duration, node string) error {
		ctx := context.Background()
		if timeout > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, timeout)
			defer cancel()
		}
		ctx = md.WithIdentity(ctx, md.Identity{RunID: "r", NodeID: node})
		_, err := meshv1.NewNodeReportServiceClient(cc).ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r"})
		return err
	}
	for range 3 {
		if err := call(time.Second, "ok"); err != nil {
			t.Fatal(err)
		}
	}
	if err := call(0, "ok"); err != nil { // no deadline: the policy's default, 2 s
		t.Fatal(err)
	}
	if err := call(time.Minute, "ok"); err != nil { // capped at 5 s
		t.Fatal(err)
	}
	if err := call(time.Second, "fail"); status.Code(err) != codes.NotFound {
		t.Fatalf("want NotFound, got %v", err)
	}
	// A panic is counted with the code the caller receives: INTERNAL (recovery runs
	// inside the metrics).
	if err := call(time.Second, "panic"); status.Code(err) != codes.Internal {
		t.Fatalf("want Internal, got %v", err)
	}
	lbl := map[string]string{"grpc_service": "curfew.mesh.v1.NodeReportService", "grpc_method": "ListNodes"}
	with := func(k, v string) map[string]string {
		m := map[string]string{k: v}
		for a, b := range lbl {
			m[a] = b
		}
		return m
	}
	for _, c := range []struct {
		reg  *prometheus.Registry
		name string
		code string
		want float64
	}{
		{srvReg, "grpc_server_handled_total", "OK", 5}, {srvReg, "grpc_server_handled_total", "NotFound", 1},
		{srvReg, "grpc_server_handled_total", "Internal", 1}, {srvReg, "grpc_server_msg_sent_total", "", 5},
		{cliReg, "grpc_client_handled_total", "OK", 5}, {cliReg, "grpc_client_handled_total", "NotFound", 1},
		{cliReg, "grpc_client_handled_total", "Internal", 1},
	} {
		match := with("grpc_code", c.code)
		if c.code == "" {
			match = lbl
		}
		if got := metric(t, c.reg, c.name, match).GetCounter().GetValue(); got != c.want {
			t.Errorf("%s{grpc_code=%s} = %v, want %v", c.name, c.code, got, c.want)
		}
	}
	for _, name := range []string{"grpc_server_started_total", "grpc_server_msg_received_total"} {
		if got := metric(t, srvReg, name, lbl).GetCounter().GetValue(); got != 7 {
			t.Errorf("%s = %v, want 7", name, got)
		}
	}
	if h := metric(t, srvReg, "grpc_server_handling_seconds", lbl).GetHistogram(); h.GetSampleCount() != 7 {
		t.Errorf("grpc_server_handling_seconds count = %v, want 7", h.GetSampleCount())
	}
	if h := metric(t, cliReg, "grpc_client_handling_seconds", lbl).GetHistogram(); h.GetSampleCount() != 7 {
		t.Errorf("grpc_client_handling_seconds count = %v, want 7", h.GetSampleCount())
	}

	// Slack: five calls with 1 s, one with the 2 s default, one capped at 5 s. Each
	// arrives with a little less than it was given (bound: 1 s of transit on a loaded
	// machine), never more.
	h := metric(t, srvReg, "curfew_deadline_slack_seconds", map[string]string{"method": "/curfew.mesh.v1.NodeReportService/ListNodes"}).GetHistogram()
	if h.GetSampleCount() != 7 {
		t.Fatalf("slack observed %d times, want 7", h.GetSampleCount())
	}
	const given = 5*1 + 2 + 5
	if s := h.GetSampleSum(); s > given || s < given-7*1 {
		t.Errorf("slack sum %.3fs, want at most %ds and at least %ds", s, given, given-7)
	}
	le := map[float64]uint64{}
	for _, b := range h.GetBucket() {
		le[b.GetUpperBound()] = b.GetCumulativeCount()
	}
	if le[1] != 5 || le[2.5] != 6 || le[5] != 7 {
		t.Errorf("slack buckets le=1: %d, le=2.5: %d, le=5: %d; want 5, 6, 7", le[1], le[2.5], le[5])
	}
	// Every curfew_ metric has help text, and the chain's pass the linter's checks.
	for _, reg := range []*prometheus.Registry{srvReg, cliReg} {
		problems, err := testutil.GatherAndLint(reg)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range problems {
			t.Errorf("lint: %s: %s", p.Metric, p.Text)
		}
	}
}

// Every call the server handled ends with one JSON log line carrying the work's identity,
// the code as error_type and elapsed_ms; successes only at debug.
func TestChainFinishLog(t *testing.T) {
	var logs syncBuffer
	log := slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo}))
	_, _, cc := metricsPair(t, log, func(ctx context.Context) error {
		if md.IdentityFrom(ctx).NodeID == "root/slow" {
			time.Sleep(20 * time.Millisecond)
			return status.Error(codes.Unavailable, "backend down")
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c := meshv1.NewNodeReportServiceClient(cc)
	if _, err := c.ListNodes(md.WithIdentity(ctx, md.Identity{RunID: "r1", NodeID: "root/ok"}), &meshv1.ListNodesRequest{RunId: "r1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.ListNodes(md.WithIdentity(ctx, md.Identity{RunID: "r1", NodeID: "root/slow"}), &meshv1.ListNodesRequest{RunId: "r1"}); status.Code(err) != codes.Unavailable {
		t.Fatalf("want Unavailable, got %v", err)
	}
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 1 {
		t.Fatalf("want one line (the success is debug), got %d:\n%s", len(lines), logs.String())
	}
	var rec map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &rec); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"level": "WARN", "msg": "call finished", "method": "/curfew.mesh.v1.NodeReportService/ListNodes",
		"run_id": "r1", "node_id": "root/slow", "attempt": 1.0, "error_type": "Unavailable", "error": "backend down"}
	for k, v := range want {
		if rec[k] != v {
			t.Errorf("%s = %v, want %v (line %s)", k, rec[k], v, lines[0])
		}
	}
	if id, _ := rec["retry_id"].(string); id == "" {
		t.Errorf("no retry_id (the client chain mints one per call): %s", lines[0])
	}
	if ms, ok := rec["elapsed_ms"].(float64); !ok || ms < 20 {
		t.Errorf("elapsed_ms = %v, want at least 20", rec["elapsed_ms"])
	}
	for _, c := range []struct {
		code codes.Code
		want slog.Level
	}{{codes.OK, slog.LevelDebug}, {codes.Canceled, slog.LevelInfo}, {codes.DeadlineExceeded, slog.LevelInfo},
		{codes.ResourceExhausted, slog.LevelWarn}, {codes.Internal, slog.LevelError}, {codes.Unknown, slog.LevelError}} {
		if got := mesh.FinishLevel(c.code); got != c.want {
			t.Errorf("FinishLevel(%v) = %v, want %v", c.code, got, c.want)
		}
	}
}
