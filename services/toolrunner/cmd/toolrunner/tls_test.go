package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"log/slog"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// pki is a CA and the certificates it issued, as PEM files in a directory.
type pki struct {
	dir    string
	ca     *x509.Certificate
	caKey  *ecdsa.PrivateKey
	caPool *x509.CertPool
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test tools CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(der)
	p := &pki{dir: t.TempDir(), ca: ca, caKey: key, caPool: x509.NewCertPool()}
	p.caPool.AddCert(ca)
	p.write(t, "ca.pem", "CERTIFICATE", der)
	return p
}

func (p *pki) write(t *testing.T, name, typ string, der []byte) string {
	t.Helper()
	path := filepath.Join(p.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// issue writes a certificate for dnsName (server or client use) and its key; it returns
// their files and the pair.
func (p *pki) issue(t *testing.T, name, dnsName string, usage x509.ExtKeyUsage) (certFile, keyFile string, pair tls.Certificate) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: dnsName},
		DNSNames: []string{dnsName}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.ca, &key.PublicKey, p.caKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = p.write(t, name+".pem", "CERTIFICATE", der), p.write(t, name+"-key.pem", "EC PRIVATE KEY", kder)
	pair, err = tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		t.Fatal(err)
	}
	return certFile, keyFile, pair
}

// A grpc source with tls reaches a ToolService that serves TLS and requires a client
// certificate: it verifies the server by the configured CA and server name and presents
// its certificate; its calls go through the mesh's client chain (the client metrics
// count them, by ToolService method). The same server configured without tls (plaintext,
// the default) never lists.
func TestRegistryWithGRPCOverTLS(t *testing.T) {
	p := newPKI(t)
	_, _, serverPair := p.issue(t, "server", "tools.test", x509.ExtKeyUsageServerAuth)
	clientCert, clientKey, _ := p.issue(t, "client", "toolrunner", x509.ExtKeyUsageClientAuth)

	srv := toolserver.New(toolserver.Tool{Name: "lookup", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
		Handler: func(_ context.Context, c toolserver.Call, _ func(done, total float64, msg string)) (json.RawMessage, error) {
			return json.RawMessage(`{"run":"` + c.RunID + `"}`), nil
		}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS12,
		Certificates: []tls.Certificate{serverPair}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: p.caPool})))
	srv.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()

	file := `{"sources": [
	  {"name": "secure", "kind": "grpc", "address": "` + lis.Addr().String() + `", "trusted": true,
	   "tls": {"ca_file": "` + filepath.Join(p.dir, "ca.pem") + `", "cert_file": "` + clientCert + `", "key_file": "` + clientKey + `", "server_name": "tools.test"}},
	  {"name": "plain", "kind": "grpc", "address": "` + lis.Addr().String() + `", "trusted": true}]}`
	cfg, err := registry.Parse([]byte(file), os.LookupEnv, exec.LookPath)
	if err != nil {
		t.Fatal(err)
	}
	promReg := prometheus.NewRegistry()
	metrics := mesh.NewClientMetrics(promReg)
	chain := func(rc retry.Config) []grpc.DialOption {
		return mesh.DialOptions(mesh.ClientConfig{Retry: rc, Metrics: metrics})
	}
	reg, err := registry.New(cfg, registry.Options{Openers: openers(chain), Logger: slog.New(slog.DiscardHandler),
		Breaker: breaker.Config{OpenTimeout: 100 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reg.Close() }()
	waitFor(t, "the TLS source's tools", func() bool {
		_, err := reg.Prepare("", "secure__lookup", []byte(`{}`))
		return err == nil
	})
	pr, err := reg.Prepare("", "secure__lookup", []byte(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := pr.Run(ctx, source.Meta{RunID: "r-tls", NodeID: "root/s0.t0", RetryID: "x", Attempt: 1}, func(*meshv1.Progress) {})
	if err != nil || string(res.Output) != `{"run":"r-tls"}` {
		t.Fatalf("secure__lookup: %s %v", res.Output, err)
	}
	// Through the chain: the client metrics counted the listing and the call.
	for _, m := range []string{"ListTools", "CallTool"} {
		if v := counter(t, promReg, "grpc_client_started_total", map[string]string{"grpc_service": "curfew.tool.v1.ToolService", "grpc_method": m}); v < 1 {
			t.Errorf("grpc_client_started_total{grpc_method=%q} = %v, want at least 1", m, v)
		}
	}
	// Plaintext to a TLS server: the source is down, its tools never listed.
	_, err = reg.Prepare("", "plain__lookup", []byte(`{}`))
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "source plain is down") {
		t.Errorf("the plaintext source: %v, want UNAVAILABLE, down", err)
	}
}

// counter returns the value of the counter name with labels, summed over its other labels.
func counter(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for k, v := range labels {
				found := false
				for _, lp := range m.GetLabel() {
					if lp.GetName() == k && lp.GetValue() == v {
						found = true
					}
				}
				if !found {
					continue metric
				}
			}
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}
