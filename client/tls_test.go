package client_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/client"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// meshFiles makes a mesh CA in a temporary directory and issues identities' certificates.
func meshFiles(t *testing.T, identities ...string) string {
	t.Helper()
	dir := t.TempDir()
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range identities {
		if err := ca.Issue(dir, id, 0); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// serverCreds is the gRPC server option of identity's certificate in dir.
func serverCreds(t *testing.T, dir, identity string, auth meshtls.ClientAuth) []grpc.ServerOption {
	t.Helper()
	src, err := meshtls.NewSource(dir, identity)
	if err != nil {
		t.Fatal(err)
	}
	return []grpc.ServerOption{grpc.Creds(meshtls.ServerCredentials(src, auth))}
}

// WithMeshTLS presents the mesh identity's certificate and accepts only a server with
// the orchestrator's identity.
func TestWithMeshTLS(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	dir := meshFiles(t, meshtls.Orchestrator, meshtls.CLI, meshtls.ToolRunner)

	c, err := serveWith(t, &scripted{}, serverCreds(t, dir, meshtls.Orchestrator, meshtls.RequireClientCert), client.WithMeshTLS(dir, meshtls.CLI))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, "r1"); err != nil {
		t.Errorf("Get over mTLS as curfew-cli: %v", err)
	}

	impostor, err := serveWith(t, &scripted{}, serverCreds(t, dir, meshtls.ToolRunner, meshtls.RequireClientCert), client.WithMeshTLS(dir, meshtls.CLI))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := impostor.Get(ctx, "r1"); status.Code(err) != codes.Unavailable {
		t.Errorf("Get from a server with toolrunner's identity: %v, want UNAVAILABLE (handshake refused)", err)
	}

	if _, err := client.New("127.0.0.1:1", client.WithMeshTLS(t.TempDir(), meshtls.CLI)); err == nil {
		t.Error("WithMeshTLS of a directory without the files: no error")
	}
}

// WithTLS takes the caller's tls.Config: an outside caller that trusts the mesh CA and
// sends an API key, without a client certificate.
func TestWithTLS(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	dir := meshFiles(t, meshtls.Orchestrator)
	pem, err := os.ReadFile(filepath.Join(dir, meshtls.CACertFile)) //nolint:gosec // the test's own directory
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		t.Fatal("ca.crt holds no certificate")
	}
	s := &scripted{}
	cfg := &tls.Config{RootCAs: roots, ServerName: "localhost", MinVersion: tls.VersionTLS13}
	c, err := serveWith(t, s, serverCreds(t, dir, meshtls.Orchestrator, meshtls.VerifyClientCertIfGiven), client.WithTLS(cfg), client.WithAPIKey("cfk_remote"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, "r1"); err != nil {
		t.Fatalf("Get over TLS: %v", err)
	}
	if got := s.seen(); len(got) != 1 || got[0].auth != "Bearer cfk_remote" {
		t.Errorf("attempts %+v, want 1 with the key", got)
	}
}
