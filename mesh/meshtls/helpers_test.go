package meshtls_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// quiet discards a Source's logs.
var quiet = meshtls.WithLogger(slog.New(slog.DiscardHandler))

// testInterval is the Sources' reload interval in the tests.
const testInterval = 20 * time.Millisecond

// identities are all the mesh identities.
var identities = []string{meshtls.Orchestrator, meshtls.ToolRunner, meshtls.Subagent, meshtls.ModelProxy, meshtls.CLI}

// testMesh is a CA directory with a certificate for every identity.
type testMesh struct {
	dir string
	ca  *meshtls.CA
}

func newMesh(t testing.TB) *testMesh {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "tls")
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	m := &testMesh{dir: dir, ca: ca}
	for _, id := range identities {
		m.issue(t, id)
	}
	return m
}

func (m *testMesh) issue(t testing.TB, id string) {
	t.Helper()
	if err := m.ca.Issue(m.dir, id, 0); err != nil {
		t.Fatal(err)
	}
}

// source returns a Source of id with the test interval and no logs.
func (m *testMesh) source(t testing.TB, id string) *meshtls.Source {
	t.Helper()
	src, err := meshtls.NewSource(m.dir, id, meshtls.WithReloadInterval(testInterval), quiet)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// leaf reads the certificate in the file of id.
func (m *testMesh) leaf(t testing.TB, id string) *x509.Certificate {
	t.Helper()
	pair, err := tls.LoadX509KeyPair(filepath.Join(m.dir, id+".crt"), filepath.Join(m.dir, id+".key"))
	if err != nil {
		t.Fatal(err)
	}
	return pair.Leaf
}

// seen is what a test server saw of its callers: the last one's identity and
// certificate serial number, and every serial number.
type seen struct {
	mu       sync.Mutex
	identity string
	serial   *big.Int
	serials  map[string]bool
}

func (s *seen) record(ctx context.Context) {
	id, _ := meshtls.PeerIdentity(ctx)
	var serial *big.Int
	if p, ok := peer.FromContext(ctx); ok {
		if info, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(info.State.PeerCertificates) > 0 {
			serial = info.State.PeerCertificates[0].SerialNumber
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.identity, s.serial = id, serial
	if serial != nil {
		if s.serials == nil {
			s.serials = map[string]bool{}
		}
		s.serials[serial.String()] = true
	}
}

// saw reports whether a caller presented the certificate of serial.
func (s *seen) saw(serial *big.Int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.serials[serial.String()]
}

func (s *seen) last() (string, *big.Int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.identity, s.serial
}

// server is a test gRPC server: health (SERVING) and reflection, the curfew services
// of register unimplemented, so that a call that passes the policy fails UNIMPLEMENTED.
type server struct {
	addr   string
	health *health.Server
	seen   *seen
}

// serve starts a server with creds (nil: plaintext) and pol (nil: none) on loopback,
// stopped by t.Cleanup, serving the services of the curfew service name.
func serve(t testing.TB, creds credentials.TransportCredentials, pol *meshtls.Policy, name string) *server {
	t.Helper()
	s := &server{health: health.NewServer(), seen: &seen{}}
	unary := []grpc.UnaryServerInterceptor{func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		s.seen.record(ctx)
		return h(ctx, req)
	}}
	var stream []grpc.StreamServerInterceptor
	if pol != nil {
		unary = append(unary, pol.UnaryServerInterceptor())
		stream = append(stream, pol.StreamServerInterceptor())
	}
	opts := []grpc.ServerOption{grpc.ChainUnaryInterceptor(unary...), grpc.ChainStreamInterceptor(stream...)}
	if creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	srv := grpc.NewServer(opts...)
	healthpb.RegisterHealthServer(srv, s.health)
	reflection.Register(srv)
	switch name {
	case meshtls.Orchestrator:
		orchestratorv1.RegisterOrchestratorServiceServer(srv, orchestratorv1.UnimplementedOrchestratorServiceServer{})
		orchestratorv1.RegisterDeadLetterServiceServer(srv, orchestratorv1.UnimplementedDeadLetterServiceServer{})
	case meshtls.ToolRunner:
		toolrunnerv1.RegisterToolRunnerServiceServer(srv, toolrunnerv1.UnimplementedToolRunnerServiceServer{})
		meshv1.RegisterNodeReportServiceServer(srv, meshv1.UnimplementedNodeReportServiceServer{})
	case meshtls.Subagent:
		subagentv1.RegisterSubagentServiceServer(srv, subagentv1.UnimplementedSubagentServiceServer{})
		meshv1.RegisterNodeReportServiceServer(srv, meshv1.UnimplementedNodeReportServiceServer{})
	case meshtls.ModelProxy:
		modelproxyv1.RegisterModelProxyServiceServer(srv, modelproxyv1.UnimplementedModelProxyServiceServer{})
		meshv1.RegisterNodeReportServiceServer(srv, meshv1.UnimplementedNodeReportServiceServer{})
	}
	s.addr = listenAndServe(t, srv)
	return s
}

// listenAndServe serves srv on a loopback port until tb ends and returns its address.
func listenAndServe(tb testing.TB, srv *grpc.Server) string {
	tb.Helper()
	var lc net.ListenConfig
	lis, err := lc.Listen(tb.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	tb.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return lis.Addr().String()
}

// dial returns a connection to addr with creds, closed by t.Cleanup.
func dial(t testing.TB, addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// check makes a health Check on conn and returns the TLS state of its connection.
func check(ctx context.Context, conn *grpc.ClientConn) (tls.ConnectionState, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var p peer.Peer
	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p)); err != nil {
		return tls.ConnectionState{}, err
	}
	info, _ := p.AuthInfo.(credentials.TLSInfo)
	return info.State, nil
}

// checkOnce dials addr with creds, makes one health Check on the new connection, closes
// it and returns the connection's TLS state.
func checkOnce(ctx context.Context, addr string, creds credentials.TransportCredentials) (tls.ConnectionState, error) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		return tls.ConnectionState{}, err
	}
	defer conn.Close()
	return check(ctx, conn)
}

// serial returns the serial number of the server certificate of a client's state.
func serial(cs tls.ConnectionState) *big.Int {
	if len(cs.PeerCertificates) == 0 {
		return nil
	}
	return cs.PeerCertificates[0].SerialNumber
}

// copyFiles copies the named files of dir to a new directory and returns it.
func copyFiles(t testing.TB, dir string, names ...string) string {
	t.Helper()
	out := t.TempDir()
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(dir, n))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(out, n), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// eventually calls cond until it is true, failing the test after 10s.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("not within 10s: %s", what)
		}
	}
}
