package service_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/service"
)

// meshDir returns a directory with a mesh CA and a certificate for each identity.
func meshDir(t *testing.T) (string, *meshtls.CA) {
	t.Helper()
	dir := t.TempDir()
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{meshtls.Orchestrator, meshtls.ToolRunner, meshtls.Subagent, meshtls.ModelProxy, meshtls.CLI} {
		if err := ca.Issue(dir, id, 0); err != nil {
			t.Fatal(err)
		}
	}
	return dir, ca
}

func tlsOptions(name, dir string) service.Options {
	o := validOptions()
	o.Name, o.TLSDir, o.Insecure = name, dir, false
	return o
}

// clientAs returns a connection to addr presenting identity's certificate from dir and
// verifying that the server is server.
func clientAs(t *testing.T, dir, identity, server, addr string) *grpc.ClientConn {
	t.Helper()
	src, err := meshtls.NewSource(dir, identity)
	if err != nil {
		t.Fatal(err)
	}
	return dialWith(t, addr, meshtls.ClientCredentials(src, server))
}

func dialWith(t *testing.T, addr string, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// noCertCreds trusts the mesh CA of dir but presents no certificate.
func noCertCreds(t *testing.T, dir string) credentials.TransportCredentials {
	t.Helper()
	pem, err := os.ReadFile(filepath.Join(dir, meshtls.CACertFile))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatal("ca.crt holds no certificate")
	}
	return credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: "localhost", MinVersion: tls.VersionTLS13})
}

func healthCheck(cc *grpc.ClientConn) (healthpb.HealthCheckResponse_ServingStatus, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
	return resp.GetStatus(), err
}

// With --tls-dir a service serves mTLS only, authorizes by the call graph, and its Dial
// presents its own certificate; TLS metrics are on the admin port.
func TestTLSServerAuthorizesByCallGraph(t *testing.T) {
	dir, _ := meshDir(t)
	f := &failing{code: codes.NotFound} // a call that reaches the handler ends NOT_FOUND
	tr := start(t, tlsOptions(meshtls.ToolRunner, dir), func(s *grpc.Server) { toolrunnerv1.RegisterToolRunnerServiceServer(s, f) })
	addr := tr.rt.Addr()
	if tr.rt.TLS() == nil || tr.rt.TLS().Identity() != meshtls.ToolRunner {
		t.Fatalf("TLS() = %v", tr.rt.TLS())
	}

	// The orchestrator and the subagent may call Execute.
	for _, id := range []string{meshtls.Orchestrator, meshtls.Subagent} {
		if err := execute(t, clientAs(t, dir, id, meshtls.ToolRunner, addr)); status.Code(err) != codes.NotFound {
			t.Errorf("%s calling Execute: %v, want the handler's NOT_FOUND", id, err)
		}
	}
	// The modelproxy may not.
	err := execute(t, clientAs(t, dir, meshtls.ModelProxy, meshtls.ToolRunner, addr))
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "modelproxy may not call /curfew.toolrunner.v1.ToolRunnerService/Execute") {
		t.Errorf("modelproxy calling Execute: %v, want PERMISSION_DENIED naming the method", err)
	}
	// Health: any mesh identity.
	if st, err := healthCheck(clientAs(t, dir, meshtls.CLI, meshtls.ToolRunner, addr)); err != nil || st != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("curfew-cli health check: %v %v", st, err)
	}
	// Without a client certificate, or in plaintext, nothing gets through.
	if err := execute(t, dialWith(t, addr, noCertCreds(t, dir))); status.Code(err) != codes.Unavailable {
		t.Errorf("Execute without a client certificate: %v, want UNAVAILABLE (handshake refused)", err)
	}
	if err := execute(t, dialWith(t, addr, insecure.NewCredentials())); status.Code(err) != codes.Unavailable {
		t.Errorf("plaintext Execute: %v, want UNAVAILABLE", err)
	}
	// A client dialling the toolrunner as if it were the subagent refuses its certificate.
	if err := execute(t, clientAs(t, dir, meshtls.Orchestrator, meshtls.Subagent, addr)); status.Code(err) != codes.Unavailable {
		t.Errorf("dialling toolrunner as subagent: %v, want UNAVAILABLE", err)
	}
	if got := f.calls.Load(); got != 2 {
		t.Errorf("handler ran %d times, want 2 (only the allowed calls)", got)
	}

	// Runtime.Dial of another service presents its certificate.
	orch, err := service.New(context.Background(), tlsOptions(meshtls.Orchestrator, dir), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer orch.Server.Stop()
	cc, err := orch.Dial(meshtls.ToolRunner, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if err := execute(t, cc); status.Code(err) != codes.NotFound {
		t.Errorf("orchestrator's Runtime.Dial: %v, want the handler's NOT_FOUND", err)
	}

	// The TLS metrics; the refusal is counted by the gRPC server metrics.
	_, body := get(t, tr.admin+"/metrics")
	want := fmt.Sprintf("curfew_tls_cert_expiry_timestamp_seconds %g", float64(tr.rt.TLS().Certificate().NotAfter.Unix()))
	for _, w := range []string{want, "curfew_tls_reload_errors_total 0", `grpc_code="PermissionDenied",grpc_method="Execute"`} {
		if !strings.Contains(body, w) {
			t.Errorf("/metrics lacks %q", w)
		}
	}
}

// The orchestrator serves its public API to callers without a client certificate, but
// nothing else.
func TestTLSOrchestratorPublicAPI(t *testing.T) {
	dir, _ := meshDir(t)
	o := start(t, tlsOptions(meshtls.Orchestrator, dir), func(s *grpc.Server) {
		orchestratorv1.RegisterOrchestratorServiceServer(s, orchestratorv1.UnimplementedOrchestratorServiceServer{})
	})
	cc := dialWith(t, o.rt.Addr(), noCertCreds(t, dir))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := orchestratorv1.NewOrchestratorServiceClient(cc).GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: "r"})
	if status.Code(err) != codes.Unimplemented {
		t.Errorf("GetRun without a client certificate: %v, want the handler's UNIMPLEMENTED", err)
	}
	if _, err := healthCheck(cc); status.Code(err) != codes.Unauthenticated {
		t.Errorf("health without a client certificate: %v, want UNAUTHENTICATED", err)
	}
	if _, err := healthCheck(clientAs(t, dir, meshtls.CLI, meshtls.Orchestrator, o.rt.Addr())); err != nil {
		t.Errorf("health as curfew-cli: %v", err)
	}
}

func TestTLSFlags(t *testing.T) {
	o := validOptions()
	o.TLSDir, o.Insecure = t.TempDir(), true
	if err := o.Validate(); err == nil || !strings.Contains(err.Error(), "exclusive") {
		t.Errorf("--tls-dir with --insecure: %v", err)
	}
	o = validOptions()
	o.Insecure = false
	if err := o.Validate(); err == nil || !strings.Contains(err.Error(), "mTLS is required") {
		t.Errorf("neither --tls-dir nor --insecure: %v", err)
	}
	o.Name, o.TLSDir = meshtls.ToolRunner, t.TempDir()
	if _, err := service.New(context.Background(), o, nil); err == nil || !strings.Contains(err.Error(), "--tls-dir") {
		t.Errorf("New with an empty --tls-dir: %v", err)
	}
	dir, _ := meshDir(t)
	o = tlsOptions("test", dir) // "test" is no mesh identity
	if _, err := service.New(context.Background(), o, nil); err == nil || !strings.Contains(err.Error(), "--tls-dir") {
		t.Errorf("New with --tls-dir for a service without an identity: %v", err)
	}
}

// --health-addr serves plaintext grpc.health.v1 only, the same status as --addr, and
// stops with the server.
func TestHealthAddr(t *testing.T) {
	dir, _ := meshDir(t)
	o := tlsOptions(meshtls.ToolRunner, dir)
	o.HealthAddr = "127.0.0.1:0"
	o.DrainDelay = 2 * time.Second
	r := start(t, o, func(s *grpc.Server) {
		toolrunnerv1.RegisterToolRunnerServiceServer(s, &failing{code: codes.NotFound})
	})
	ha := r.rt.HealthAddr()
	if ha == "" || ha == r.rt.Addr() {
		t.Fatalf("HealthAddr() = %q", ha)
	}
	cc := dialWith(t, ha, insecure.NewCredentials())
	if st, err := healthCheck(cc); err != nil || st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("plaintext health on --health-addr: %v %v", st, err)
	}
	if err := execute(t, cc); status.Code(err) != codes.Unimplemented {
		t.Errorf("Execute on --health-addr: %v, want UNIMPLEMENTED (health only)", err)
	}
	// The drain turns it NOT_SERVING while the server still serves, then it closes.
	r.stop()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st, err := healthCheck(cc)
		if err == nil && st == healthpb.HealthCheckResponse_NOT_SERVING {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("--health-addr during the drain: %v %v, want NOT_SERVING", st, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	select {
	case err := <-r.done:
		r.done <- err // for start's cleanup
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return")
	}
	if _, err := healthCheck(cc); status.Code(err) != codes.Unavailable {
		t.Errorf("--health-addr after the stop: %v, want UNAVAILABLE", err)
	}

	// A busy --health-addr is a start-up error.
	o = validOptions()
	busy := start(t, validOptions(), nil)
	o.HealthAddr = busy.rt.Addr()
	if _, err := service.New(context.Background(), o, nil); err == nil || !strings.Contains(err.Error(), "--health-addr") {
		t.Errorf("New on a busy --health-addr: %v", err)
	}
}
