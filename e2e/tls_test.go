package e2e

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// The mTLS tests, on the shared mesh, which `curfew up` runs
// with mTLS: its CA and certificates are in mesh.Endpoints.TLSDir.

func requireTLS(t *testing.T) string {
	t.Helper()
	if !mesh.TLS() {
		t.Fatal("the shared mesh does not run mTLS: curfew up must pass --tls-dir by default")
	}
	return mesh.Endpoints.TLSDir
}

// meshPool is the mesh's trusted CAs.
func meshPool(t *testing.T, dir string) *x509.CertPool {
	t.Helper()
	pem, err := os.ReadFile(filepath.Join(dir, meshtls.CACertFile))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		t.Fatal("ca.crt holds no certificate")
	}
	return pool
}

// tlsCreds are plain TLS credentials that trust the mesh CA (so the client accepts the
// server) and present pair, or no certificate when pair is nil.
func tlsCreds(t *testing.T, dir string, pair *tls.Certificate) credentials.TransportCredentials {
	t.Helper()
	cfg := &tls.Config{RootCAs: meshPool(t, dir), ServerName: "localhost", MinVersion: tls.VersionTLS13}
	if pair != nil {
		// Sent whatever CAs the server asks for (crypto/tls would otherwise send no
		// certificate of a CA the server does not name).
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return pair, nil }
	}
	return credentials.NewTLS(cfg)
}

func loadPair(t *testing.T, dir, identity string) *tls.Certificate {
	t.Helper()
	p, err := tls.LoadX509KeyPair(filepath.Join(dir, identity+".crt"), filepath.Join(dir, identity+".key"))
	if err != nil {
		t.Fatal(err)
	}
	return &p
}

// directCall makes the call a client of service would make first: Execute on
// toolrunner, Generate on modelproxy, Spawn on subagent, health elsewhere.
func directCall(ctx context.Context, cc *grpc.ClientConn, service string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// A node of a run of its own, as the services' calls carry one.
	ctx = metadata.AppendToOutgoingContext(ctx, md.RunID, "e2e-tls-"+strconv.FormatInt(time.Now().UnixNano(), 36), md.NodeID, "root/s0.t0")
	var recv func() error
	switch service {
	case "toolrunner":
		st, err := toolrunnerv1.NewToolRunnerServiceClient(cc).Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "sleep", ArgsJson: `{"ms": 1}`})
		if err != nil {
			return err
		}
		recv = func() error { _, err := st.Recv(); return err }
	case "modelproxy":
		st, err := modelproxyv1.NewModelProxyServiceClient(cc).Generate(ctx, &modelproxyv1.GenerateRequest{Model: "sim"})
		if err != nil {
			return err
		}
		recv = func() error { _, err := st.Recv(); return err }
	case "subagent":
		st, err := subagentv1.NewSubagentServiceClient(cc).Spawn(ctx, &subagentv1.SpawnRequest{Task: `{"steps": [{"answer_tokens": 1}]}`})
		if err != nil {
			return err
		}
		recv = func() error { _, err := st.Recv(); return err }
	default:
		_, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
		return err
	}
	return recv()
}

func dialDirect(t *testing.T, service string, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(mesh.Endpoints.Services[service].Addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// (a) A client without a mesh certificate cannot call toolrunner or modelproxy: not
// without a certificate (though it trusts the mesh CA), not with one from another CA,
// not in plaintext. The same TLS setup with the mesh's curfew-cli certificate gets
// through the handshake, and the orchestrator's public API needs no certificate (but an
// API key).
func TestTLSRefusesClientsWithoutMeshCertificate(t *testing.T) {
	t.Parallel()
	dir := requireTLS(t)
	other := t.TempDir()
	oca, err := meshtls.EnsureCA(other)
	if err != nil {
		t.Fatal(err)
	}
	if err := oca.Issue(other, meshtls.Orchestrator, 0); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, svc := range []string{"toolrunner", "modelproxy"} {
		cases := []struct {
			name  string
			creds credentials.TransportCredentials
		}{
			{"no client certificate", tlsCreds(t, dir, nil)},
			{"certificate of another CA", tlsCreds(t, dir, loadPair(t, other, meshtls.Orchestrator))},
			{"plaintext", insecure.NewCredentials()},
		}
		for _, tc := range cases {
			err := directCall(ctx, dialDirect(t, svc, tc.creds), svc)
			if status.Code(err) != codes.Unavailable {
				t.Errorf("%s, %s: %v, want UNAVAILABLE (connection refused at the handshake)", svc, tc.name, err)
			} else {
				t.Logf("%s, %s: %v", svc, tc.name, err)
			}
		}
		// Control: the same client setup with a mesh certificate is served.
		if err := directCall(ctx, dialDirect(t, svc, tlsCreds(t, dir, loadPair(t, dir, meshtls.CLI))), "health"); err != nil {
			t.Errorf("%s health with curfew-cli's certificate: %v", svc, err)
		}
	}
	// The orchestrator takes a TLS client without a certificate, whose public API calls
	// then need an API key (auth_test.go)...
	cc := dialDirect(t, "orchestrator", tlsCreds(t, dir, nil))
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := orchestratorv1.NewOrchestratorServiceClient(cc).ListRuns(cctx, &orchestratorv1.ListRunsRequest{PageSize: 1}); status.Code(err) != codes.Unauthenticated ||
		!strings.Contains(status.Convert(err).Message(), "API key") {
		t.Errorf("orchestrator ListRuns without a client certificate or a key: %v, want UNAUTHENTICATED asking for an API key", err)
	}
	// ... but not its health, which is for mesh identities, nor plaintext.
	if err := directCall(ctx, cc, "health"); status.Code(err) != codes.Unauthenticated {
		t.Errorf("orchestrator health without a client certificate: %v, want UNAUTHENTICATED", err)
	}
	if _, err := orchestratorv1.NewOrchestratorServiceClient(dialDirect(t, "orchestrator", insecure.NewCredentials())).ListRuns(cctx, &orchestratorv1.ListRunsRequest{PageSize: 1}); status.Code(err) != codes.Unavailable {
		t.Errorf("orchestrator ListRuns in plaintext: %v, want UNAVAILABLE", err)
	}
}

// (b) A mesh identity calling a method outside the call graph gets PERMISSION_DENIED
// naming itself and the method, counted by the server's gRPC metrics; the same method
// from an identity the graph allows is served.
func TestTLSCallGraphDenies(t *testing.T) {
	t.Parallel()
	requireTLS(t)
	ctx := context.Background()
	before := scrapeParsed(t, mesh, "toolrunner")
	denied := []struct{ caller, server, method string }{
		{meshtls.ModelProxy, "toolrunner", "/curfew.toolrunner.v1.ToolRunnerService/Execute"},
		{meshtls.Subagent, "subagent", "/curfew.subagent.v1.SubagentService/Spawn"}, // only toolrunner spawns
		{meshtls.ToolRunner, "modelproxy", "/curfew.modelproxy.v1.ModelProxyService/Generate"},
		{meshtls.CLI, "modelproxy", "/curfew.modelproxy.v1.ModelProxyService/Generate"},
	}
	for _, d := range denied {
		cc, err := mesh.ConnAs(d.caller, d.server)
		if err != nil {
			t.Fatal(err)
		}
		err = directCall(ctx, cc, d.server)
		want := d.caller + " may not call " + d.method
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), want) {
			t.Errorf("%s calling %s: %v, want PERMISSION_DENIED %q", d.caller, d.method, err, want)
		}
	}
	// An allowed edge: the subagent calls toolrunner's Execute.
	cc, err := mesh.ConnAs(meshtls.Subagent, "toolrunner")
	if err != nil {
		t.Fatal(err)
	}
	if err := directCall(ctx, cc, "toolrunner"); err != nil {
		t.Errorf("subagent calling Execute: %v", err)
	}
	after := scrapeParsed(t, mesh, "toolrunner")
	match := map[string]string{"grpc_method": "Execute", "grpc_code": "PermissionDenied"}
	if d := after.value("grpc_server_handled_total", match, false) - before.value("grpc_server_handled_total", match, false); d < 1 {
		t.Errorf("toolrunner's grpc_server_handled_total{Execute,PermissionDenied} rose by %v, want at least 1", d)
	}
}

// serverSerial returns the serial of the certificate service presents to a new
// connection.
func serverSerial(t *testing.T, dir, service string) *big.Int {
	t.Helper()
	src, err := meshtls.NewSource(dir, meshtls.CLI)
	if err != nil {
		t.Fatal(err)
	}
	cc := dialDirect(t, service, meshtls.ClientCredentials(src, service))
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var p peer.Peer
	if _, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.Peer(&p)); err != nil {
		t.Fatalf("%s health: %v", service, err)
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.PeerCertificates) == 0 {
		t.Fatalf("%s: no TLS peer certificate", service)
	}
	return info.State.PeerCertificates[0].SerialNumber
}

// fileCert reads identity's certificate in dir.
func fileCert(t *testing.T, dir, identity string) *x509.Certificate {
	t.Helper()
	return loadPair(t, dir, identity).Leaf
}

// failedCalls sums the series of a gRPC handled counter whose code is not OK.
func failedCalls(p page, name string) float64 {
	var total float64
	mf := p.mfs[name]
	if mf == nil {
		return 0
	}
	for _, m := range mf.GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == "grpc_code" && lp.GetValue() != "OK" {
				total += m.GetCounter().GetValue()
			}
		}
	}
	return total
}

// (c) Every service certificate re-issued (CA.Issue, what `curfew up` does at each
// start) while a run with tools, a subagent and model steps is in flight: no process
// restarts, the run succeeds with every node, no call anywhere in the mesh fails, each
// service presents its new certificate to new connections within the reload interval,
// and its expiry gauge follows. Connections established before keep their handshake's
// certificates (TLS cannot change them), which is why nothing fails. Not parallel: the
// metric deltas must be this test's own.
func TestTLSRotationDuringRun(t *testing.T) {
	dir := requireTLS(t)
	ctx := context.Background()
	pids := mesh.PIDs()
	oldSerial := map[string]*big.Int{}
	before := map[string]page{}
	for _, s := range services {
		oldSerial[s] = serverSerial(t, dir, s)
		before[s] = scrapeParsed(t, mesh, s)
	}

	const plan = `{"tokens_per_second": 40, "steps": [
	  {"think_tokens": 10, "tools": [{"name": "sleep", "args": {"ms": 4000}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [
	      {"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": 3000}}]},
	      {"answer_tokens": 40}]}}}]},
	  {"answer_tokens": 40}]}`
	done := make(chan result, 1)
	go func() {
		res, _ := runPlan(ctx, client(t), plan, time.Minute, 0, false)
		done <- res
	}()
	time.Sleep(time.Second) // the run is in its tools

	ca, err := meshtls.EnsureCA(dir) // loads the mesh's CA
	if err != nil {
		t.Fatal(err)
	}
	rotated := time.Now()
	for _, s := range services {
		if err := ca.Issue(dir, s, 0); err != nil {
			t.Fatal(err)
		}
	}
	// Each service presents its new certificate to new connections once it has looked at
	// its files again: within the reload interval of a handshake.
	for _, s := range services {
		want := fileCert(t, dir, s)
		for {
			got := serverSerial(t, dir, s)
			if got.Cmp(want.SerialNumber) == 0 {
				break
			}
			if got.Cmp(oldSerial[s]) != 0 {
				t.Fatalf("%s presents serial %x, neither the old %x nor the new %x", s, got, oldSerial[s], want.SerialNumber)
			}
			if time.Since(rotated) > 10*time.Second {
				t.Fatalf("%s still presents its old certificate %v after the rotation", s, time.Since(rotated))
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Logf("%s: serial %x -> %x after %v", s, oldSerial[s], want.SerialNumber, time.Since(rotated).Round(time.Millisecond))
	}

	var res result
	select {
	case res = <-done:
	case <-time.After(90 * time.Second):
		t.Fatal("the run did not end")
	}
	if res.err != nil || res.finished == nil {
		t.Fatalf("Run: %v (summary %v)", res.err, res.finished != nil)
	}
	r := res.finished
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("the run did not succeed:\n%s", dump(r))
	}
	if r.GetCreatedAt().AsTime().After(rotated) || r.GetEndedAt().AsTime().Before(rotated) {
		t.Fatalf("the rotation at %s was not during the run:\n%s", fmtTime(rotated), dump(r))
	}
	for _, n := range r.GetNodes() {
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			t.Errorf("node %s: %s", n.GetId(), n.GetStatus())
		}
	}
	if len(r.GetNodes()) < 7 {
		t.Errorf("%d nodes, want the whole tree:\n%s", len(r.GetNodes()), dump(r))
	}
	// A run started after the rotation goes through the new certificates too.
	if res2, _ := runPlan(ctx, client(t), `{"tokens_per_second": 200, "steps": [{"think_tokens": 5, "tools": [{"name": "spawn_subagent", "args": {"plan": {"steps": [{"answer_tokens": 5}]}}}]}, {"answer_tokens": 5}]}`, 30*time.Second, 0, false); res2.err != nil ||
		res2.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Errorf("a run after the rotation: %v %s", res2.err, res2.finished.GetStatus())
	}

	for _, s := range services {
		after := scrapeParsed(t, mesh, s)
		for _, fam := range []string{"grpc_server_handled_total", "grpc_client_handled_total"} {
			if d := failedCalls(after, fam) - failedCalls(before[s], fam); d != 0 {
				t.Errorf("%s: %v more calls failed (%s)", s, d, fam)
			}
		}
		if v := after.value("curfew_tls_reload_errors_total", nil, false); v != 0 {
			t.Errorf("%s: curfew_tls_reload_errors_total %v", s, v)
		}
		want := float64(fileCert(t, dir, s).NotAfter.Unix())
		if v := after.value("curfew_tls_cert_expiry_timestamp_seconds", nil, false); v != want {
			t.Errorf("%s: curfew_tls_cert_expiry_timestamp_seconds %v, want the new certificate's %v", s, v, want)
		}
		// No restart: the same processes.
		if pid := mesh.PIDs()[s]; pid != pids[s] || syscall.Kill(pid, 0) != nil {
			t.Errorf("%s: pid %d (was %d) not running", s, pid, pids[s])
		}
	}
	if t.Failed() {
		t.Log(dump(r))
	}
}

// `curfew up --insecure` runs the mesh plaintext, records that in endpoints.json, and
// each service warns at start that mTLS is off; the client commands follow.
func TestUpInsecure(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	m, err := meshproc.Start(ctx, dir, meshproc.Options{Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := m.Stop(); err != nil {
			t.Errorf("curfew up --insecure did not stop cleanly: %v", err)
		}
	}()
	if m.TLS() {
		t.Fatalf("endpoints.json says mTLS: %q", m.Endpoints.TLSDir)
	}
	if _, err := os.Stat(filepath.Join(dir, "tls")); !os.IsNotExist(err) {
		t.Errorf("curfew up --insecure made %s/tls: %v", dir, err)
	}
	// Plaintext works, even for a method the call graph would refuse curfew-cli.
	cc, err := m.Conn("toolrunner")
	if err != nil {
		t.Fatal(err)
	}
	if err := directCall(ctx, cc, "toolrunner"); err != nil {
		t.Errorf("plaintext Execute: %v", err)
	}
	for _, s := range services {
		b, err := os.ReadFile(filepath.Join(dir, "logs", s+".log"))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), "mTLS is off (--insecure)") || !strings.Contains(string(b), `"level":"WARN"`) {
			t.Errorf("%s does not warn that mTLS is off:\n%s", s, b)
		}
	}
	// Without mTLS no caller is a mesh peer, so the orchestrator wants an API key of
	// every one; the CLI uses the key curfew up made for it (DIR/cli.key).
	oc, err := grpc.NewClient(m.Endpoints.Services["orchestrator"].Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer oc.Close()
	if _, err := orchestratorv1.NewOrchestratorServiceClient(oc).ListRuns(metadata.AppendToOutgoingContext(ctx, md.Tenant, md.DefaultTenant),
		&orchestratorv1.ListRunsRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("plaintext ListRuns without a key: %v, want UNAUTHENTICATED", err)
	}
	if out, err := exec.CommandContext(ctx, filepath.Join(m.Bin, "curfew"), "ls", "--data-dir", dir, "--json").CombinedOutput(); err != nil {
		t.Errorf("curfew ls on a plaintext mesh: %v %s", err, out)
	}
}
