package meshtls_test

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// meshServer serves name's services with name's certificate, auth and default policy.
func meshServer(t *testing.T, m *testMesh, name string, auth meshtls.ClientAuth) *server {
	t.Helper()
	pol, err := meshtls.DefaultPolicy(name)
	if err != nil {
		t.Fatal(err)
	}
	return serve(t, meshtls.ServerCredentials(m.source(t, name), auth), pol, name)
}

// noCertCreds are TLS credentials that trust the mesh CA and verify the host name, as
// grpcurl -cacert would, but have no client certificate.
func noCertCreds(t *testing.T, m *testMesh) credentials.TransportCredentials {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(m.dir, meshtls.CACertFile))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(b)
	return credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13})
}

func TestMeshPeerIsServed(t *testing.T) {
	m := newMesh(t)
	srv := meshServer(t, m, meshtls.ToolRunner, meshtls.RequireClientCert)
	conn := dial(t, srv.addr, meshtls.ClientCredentials(m.source(t, meshtls.Orchestrator), meshtls.ToolRunner))

	cs, err := check(t.Context(), conn)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := serial(cs), m.leaf(t, meshtls.ToolRunner).SerialNumber; got.Cmp(want) != 0 {
		t.Errorf("server certificate serial %x, want toolrunner's %x", got, want)
	}
	if cs.Version != tls.VersionTLS13 {
		t.Errorf("TLS version %x, want 1.3", cs.Version)
	}
	if id, serial := srv.seen.last(); id != meshtls.Orchestrator || serial.Cmp(m.leaf(t, meshtls.Orchestrator).SerialNumber) != 0 {
		t.Errorf("server saw caller %q (serial %x), want orchestrator", id, serial)
	}
	// The call graph allows it: the call reaches the (unimplemented) handler.
	stream, err := toolrunnerv1.NewToolRunnerServiceClient(conn).Execute(t.Context(), &toolrunnerv1.ExecuteRequest{})
	if err == nil {
		_, err = stream.Recv()
	}
	meshtest.WantCode(t, err, codes.Unimplemented)
}

func TestClientWithoutCertificate(t *testing.T) {
	m := newMesh(t)
	t.Run("refused by an internal service", func(t *testing.T) {
		srv := meshServer(t, m, meshtls.ToolRunner, meshtls.RequireClientCert)
		_, err := check(t.Context(), dial(t, srv.addr, noCertCreds(t, m)))
		meshtest.WantCode(t, err, codes.Unavailable)
	})
	t.Run("served the orchestrator's public API only", func(t *testing.T) {
		srv := meshServer(t, m, meshtls.Orchestrator, meshtls.VerifyClientCertIfGiven)
		conn := dial(t, srv.addr, noCertCreds(t, m)) // also checks the IP SAN 127.0.0.1
		_, err := orchestratorv1.NewOrchestratorServiceClient(conn).GetRun(t.Context(), &orchestratorv1.GetRunRequest{RunId: "r"})
		meshtest.WantCode(t, err, codes.Unimplemented) // past the policy
		_, err = orchestratorv1.NewDeadLetterServiceClient(conn).ListDeadLetters(t.Context(), &orchestratorv1.ListDeadLettersRequest{})
		meshtest.WantCode(t, err, codes.Unimplemented)
		_, err = check(t.Context(), conn)
		meshtest.WantCode(t, err, codes.Unauthenticated, "/grpc.health.v1.Health/Check needs a curfew mesh client certificate")
		if id, _ := srv.seen.last(); id != "" {
			t.Errorf("PeerIdentity = %q for a caller without a certificate", id)
		}
	})
	t.Run("the orchestrator's health for a mesh peer", func(t *testing.T) {
		srv := meshServer(t, m, meshtls.Orchestrator, meshtls.VerifyClientCertIfGiven)
		if _, err := check(t.Context(), dial(t, srv.addr, meshtls.ClientCredentials(m.source(t, meshtls.CLI), meshtls.Orchestrator))); err != nil {
			t.Fatal(err)
		}
		if id, _ := srv.seen.last(); id != meshtls.CLI {
			t.Errorf("PeerIdentity = %q, want curfew-cli", id)
		}
	})
}

func TestCertificateOfAnotherCA(t *testing.T) {
	m, other := newMesh(t), newMesh(t)
	for _, auth := range []meshtls.ClientAuth{meshtls.RequireClientCert, meshtls.VerifyClientCertIfGiven} {
		t.Run("client/"+auth.String(), func(t *testing.T) {
			srv := meshServer(t, m, meshtls.Orchestrator, auth)
			// The stranger trusts the server's CA, but its certificate is another CA's.
			dir := copyFiles(t, other.dir, "toolrunner.crt", "toolrunner.key")
			b, _ := os.ReadFile(filepath.Join(m.dir, meshtls.CACertFile))
			if err := os.WriteFile(filepath.Join(dir, meshtls.CACertFile), b, 0o600); err != nil {
				t.Fatal(err)
			}
			src, err := meshtls.NewSource(dir, meshtls.ToolRunner, quiet)
			if err != nil {
				t.Fatal(err)
			}
			_, err = orchestratorv1.NewOrchestratorServiceClient(dial(t, srv.addr, meshtls.ClientCredentials(src, meshtls.Orchestrator))).
				GetRun(t.Context(), &orchestratorv1.GetRunRequest{RunId: "r"})
			meshtest.WantCode(t, err, codes.Unavailable)
		})
	}
	t.Run("server", func(t *testing.T) {
		srv := meshServer(t, other, meshtls.ToolRunner, meshtls.RequireClientCert)
		_, err := check(t.Context(), dial(t, srv.addr, meshtls.ClientCredentials(m.source(t, meshtls.Orchestrator), meshtls.ToolRunner)))
		meshtest.WantCode(t, err, codes.Unavailable, "unknown authority")
	})
}

func TestClientRefusesAnotherService(t *testing.T) {
	m := newMesh(t)
	srv := meshServer(t, m, meshtls.Subagent, meshtls.RequireClientCert)
	_, err := check(t.Context(), dial(t, srv.addr, meshtls.ClientCredentials(m.source(t, meshtls.Orchestrator), meshtls.ToolRunner)))
	meshtest.WantCode(t, err, codes.Unavailable, "server is spiffe://curfew.local/subagent, want spiffe://curfew.local/toolrunner")
}

func TestPeerOutsideTheCallGraph(t *testing.T) {
	m := newMesh(t)
	sub := meshServer(t, m, meshtls.Subagent, meshtls.RequireClientCert)
	conn := dial(t, sub.addr, meshtls.ClientCredentials(m.source(t, meshtls.ModelProxy), meshtls.Subagent))
	stream, err := subagentv1.NewSubagentServiceClient(conn).Spawn(t.Context(), &subagentv1.SpawnRequest{})
	if err == nil {
		_, err = stream.Recv()
	}
	meshtest.WantCode(t, err, codes.PermissionDenied, "modelproxy may not call /curfew.subagent.v1.SubagentService/Spawn")
	// Health stays open to every mesh peer.
	if _, err := check(t.Context(), conn); err != nil {
		t.Errorf("health: %v", err)
	}

	tr := meshServer(t, m, meshtls.ToolRunner, meshtls.RequireClientCert)
	cli := meshv1.NewNodeReportServiceClient(dial(t, tr.addr, meshtls.ClientCredentials(m.source(t, meshtls.CLI), meshtls.ToolRunner)))
	_, err = cli.ListNodes(t.Context(), &meshv1.ListNodesRequest{})
	meshtest.WantCode(t, err, codes.Unimplemented)
	_, err = cli.CancelNodes(t.Context(), &meshv1.CancelNodesRequest{})
	meshtest.WantCode(t, err, codes.PermissionDenied, "curfew-cli may not call /curfew.mesh.v1.NodeReportService/CancelNodes")
}

// TestPlaintextCallerHasNoIdentity: over a connection without TLS, the policy finds no
// identity, so a server left in plaintext with a policy refuses the mesh's calls.
func TestPlaintextCallerHasNoIdentity(t *testing.T) {
	pol, err := meshtls.DefaultPolicy(meshtls.ModelProxy)
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, nil, pol, meshtls.ModelProxy)
	_, err = healthpb.NewHealthClient(dial(t, srv.addr, insecureCreds())).Check(t.Context(), &healthpb.HealthCheckRequest{})
	meshtest.WantCode(t, err, codes.Unauthenticated)
}

// TestPeerIdentity checks the identity taken from certificates' URI SANs.
func TestPeerIdentity(t *testing.T) {
	if id, ok := meshtls.PeerIdentity(t.Context()); ok {
		t.Errorf("PeerIdentity without a peer = %q", id)
	}
	for _, tc := range []struct {
		uris []string
		want string
	}{
		{[]string{"spiffe://curfew.local/toolrunner"}, "toolrunner"},
		{[]string{"https://example.com/x", "spiffe://curfew.local/curfew-cli"}, "curfew-cli"},
		{[]string{"spiffe://other.domain/toolrunner"}, ""},
		{[]string{"spiffe://curfew.local/toolrunner", "spiffe://curfew.local/subagent"}, ""},
		{[]string{"spiffe://curfew.local/a/b"}, ""},
		{[]string{"spiffe://curfew.local/"}, ""},
		{[]string{"spiffe://curfew.local/Toolrunner"}, ""},
		{[]string{"spiffe://curfew.local:8443/toolrunner"}, ""},
		{[]string{"spiffe://curfew.local/toolrunner?x=1"}, ""},
		{nil, ""},
	} {
		id, ok := meshtls.PeerIdentity(peerContext(t, tc.uris...))
		if id != tc.want || ok != (tc.want != "") {
			t.Errorf("PeerIdentity(%v) = %q, %v; want %q", tc.uris, id, ok, tc.want)
		}
	}
}
