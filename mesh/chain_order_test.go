package mesh_test

import (
	"context"
	"log/slog"
	"net"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// The server chain, outermost first, as the package doc and chain.go declare it.
var wantServerChain = []string{"credentials", "header-limit", "tracing", "message-limit", "metrics", "call-log",
	"recovery", "status", "authorize", "contract", "deadline", "identity", "chaos", "authenticate", "fast-fail", "retry-id"}

// recorder collects the layers one call ran, in order.
type recorder struct {
	mu  sync.Mutex
	ran []string
}

func (r *recorder) record(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ran = append(r.ran, name)
}

func (r *recorder) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.ran
	r.ran = nil
	return out
}

// tracingRecorder is a stats handler that records "tracing" when a call begins, where
// the tracing layer's handler opens the call's span.
type tracingRecorder struct{ r *recorder }

func (t tracingRecorder) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (t tracingRecorder) HandleRPC(_ context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.Begin); ok {
		t.r.record("tracing")
	}
}
func (tracingRecorder) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (tracingRecorder) HandleConn(context.Context, stats.ConnStats)                       {}

// Every layer of the server chain records its name as a call enters it, through the
// compiled chain: a call runs them in the table's order, and a refusal stops the call at
// the layer that refuses, so the order of refusals is the order of the layers.
func TestChainLayerOrder(t *testing.T) {
	if got := mesh.ServerChainNames(); !slices.Equal(got, wantServerChain) {
		t.Fatalf("server chain table = %v, want %v", got, wantServerChain)
	}
	rec := &recorder{}
	cfg := mesh.ServerConfig{
		Tracing:           tracingRecorder{rec},
		MaxHeaderListSize: 64 << 10,
		MaxRecvMsgSize:    1 << 20,
		Deadline:          testPolicy,
		Logger:            quiet(),
		Metrics:           mesh.NewServerMetrics(prometheus.NewRegistry()),
		Authorize: func(ctx context.Context, _ string) error {
			if md.FromIncoming(ctx).NodeID == "forbidden" {
				return status.Error(codes.PermissionDenied, "not allowed")
			}
			return nil
		},
		Authenticate: func(_ context.Context, _, claimed string) (string, error) {
			if claimed == "stranger" {
				return "", status.Error(codes.Unauthenticated, "who are you")
			}
			return claimed, nil
		},
		MinTime: map[string]time.Duration{paths[0].method: time.Second, paths[1].method: time.Second},
	}
	p := &probe{fn: func(context.Context) error { rec.record("handler"); return nil }}
	cc := serveRecording(t, cfg, rec, func(srv *grpc.Server) {
		meshv1.RegisterNodeReportServiceServer(srv, p)
		healthpb.RegisterHealthServer(srv, p)
	})

	interceptors := wantServerChain[slices.Index(wantServerChain, "metrics"):]
	upTo := func(last string) []string {
		return append([]string{"tracing"}, interceptors[:slices.Index(interceptors, last)+1]...)
	}
	for _, path := range paths {
		for _, c := range []struct {
			name    string
			id      md.Identity
			timeout time.Duration
			code    codes.Code
			want    []string
		}{
			{"served", md.Identity{Tenant: "t", NodeID: "n"}, 5 * time.Second, codes.OK, append(upTo("retry-id"), "handler")},
			{"unauthorized", md.Identity{Tenant: "t", NodeID: "forbidden"}, 5 * time.Second, codes.PermissionDenied, upTo("authorize")},
			{"malformed header", md.Identity{Tenant: "t", NodeID: "n/.."}, 5 * time.Second, codes.InvalidArgument, upTo("contract")},
			{"unauthenticated", md.Identity{Tenant: "stranger"}, 5 * time.Second, codes.Unauthenticated, upTo("authenticate")},
			{"too late", md.Identity{Tenant: "t"}, 500 * time.Millisecond, codes.DeadlineExceeded, upTo("fast-fail")},
		} {
			ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
			err := path.call(md.AppendOutgoing(md.WithIdentity(ctx, c.id)), cc)
			cancel()
			if status.Code(err) != c.code {
				t.Errorf("%s/%s: got %v, want %v", path.name, c.name, err, c.code)
			}
			if got := rec.take(); !slices.Equal(got, c.want) {
				t.Errorf("%s/%s: layers ran %v, want %v", path.name, c.name, got, c.want)
			}
		}
	}
	// With --chaos the chaos layer is left out, and the other layers keep their order.
	cfg.Chaos = true
	rec2 := &recorder{}
	cc2 := serveRecording(t, cfg, rec2, func(srv *grpc.Server) {
		meshv1.RegisterNodeReportServiceServer(srv, &probe{fn: func(context.Context) error { return nil }})
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := paths[0].call(ctx, cc2); err != nil {
		t.Fatal(err)
	}
	want := slices.DeleteFunc(slices.Clone(interceptors), func(s string) bool { return s == "chaos" })
	if got := rec2.take(); !slices.Equal(got, want) {
		t.Errorf("with Chaos: layers ran %v, want %v", got, want)
	}
}

// The package doc lists both chains' layers in the tables' order, and every layer says
// why it sits where it does.
func TestChainDocMatchesTables(t *testing.T) {
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	text := string(doc)
	server := between(t, text, "// Server chain, outermost first", "// Client chain")
	client := between(t, text, "// Client chain", "// Status mapping")
	if got, want := listed(server), mesh.ServerChainNames(); !slices.Equal(got, want) {
		t.Errorf("doc.go's server chain lists %v; the table (chain.go) is %v", got, want)
	}
	if got, want := listed(client), mesh.ClientChainNames(); !slices.Equal(got, want) {
		t.Errorf("doc.go's client chain lists %v; the table (chain_client.go) is %v", got, want)
	}
	for name, why := range mesh.ChainReasons() {
		if strings.TrimSpace(why) == "" {
			t.Errorf("layer %s does not say why it sits where it does", name)
		}
	}
}

// between returns the part of text from the line that starts with from up to the one
// that starts with to.
func between(t *testing.T, text, from, to string) string {
	t.Helper()
	i := strings.Index(text, from)
	j := strings.Index(text[max(i, 0):], to)
	if i < 0 || j < 0 {
		t.Fatalf("doc.go has no section %q followed by %q", from, to)
	}
	return text[i : i+j]
}

var listItem = regexp.MustCompile(`(?m)^//\s+(\d+)\. ([a-z-]+)\b`)

// listed returns the names of a numbered list's items, checking they are numbered 1, 2, ...
func listed(section string) []string {
	var out []string
	for i, m := range listItem.FindAllStringSubmatch(section, -1) {
		if m[1] != strconv.Itoa(i+1) {
			return append(out, "(item "+m[1]+" out of sequence)")
		}
		out = append(out, m[2])
	}
	return out
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// serveRecording serves the services register adds behind the server chain of cfg, its
// layers recorded in rec, and returns a bare client connection to it (no client chain,
// so the server sees only what a call carries). The test's end stops both.
func serveRecording(t *testing.T, cfg mesh.ServerConfig, rec *recorder, register func(*grpc.Server)) *grpc.ClientConn {
	t.Helper()
	srv := grpc.NewServer(mesh.ServerOptionsRecording(cfg, rec.record)...)
	register(srv)
	lis := listen(t)
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(lis) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close(); srv.Stop(); <-served })
	return cc
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return lis
}
