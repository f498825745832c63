package cli

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// prepareTLS keeps the CA across starts and re-issues every certificate (a rotation).
func TestPrepareTLSKeepsTheCAAndReissues(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	abs, err := prepareTLS(dir)
	if err != nil {
		t.Fatal(err)
	}
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(abs, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	ca, cli := read(meshtls.CACertFile), read(meshtls.CLI+".crt")
	for _, id := range meshIdentities {
		if _, err := meshtls.NewSource(abs, id); err != nil {
			t.Errorf("%s: %v", id, err)
		}
	}
	if _, err := prepareTLS(dir); err != nil {
		t.Fatal(err)
	}
	if read(meshtls.CACertFile) != ca {
		t.Error("a second start replaced the CA")
	}
	if read(meshtls.CLI+".crt") == cli {
		t.Error("a second start did not re-issue the certificates")
	}
}

// The client commands take mTLS from endpoints.json for its own orchestrator, else from
// DIR/tls, and plaintext with --insecure or without either.
func TestClientTLSDir(t *testing.T) {
	data := t.TempDir()
	c := &common{dataDir: data}
	if got := c.tlsDir(); got != "" {
		t.Errorf("no endpoints, no DIR/tls: %q, want plaintext", got)
	}
	tlsDir, err := prepareTLS(filepath.Join(data, TLSSubdir))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.tlsDir(); got != filepath.Join(data, TLSSubdir) {
		t.Errorf("DIR/tls without endpoints: %q", got)
	}
	write := func(e Endpoints) {
		b, _ := json.Marshal(e)
		if err := os.WriteFile(filepath.Join(data, EndpointsFile), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(Endpoints{Services: map[string]Endpoint{"orchestrator": {Addr: "127.0.0.1:1"}}}) // curfew up --insecure
	if got := c.tlsDir(); got != "" {
		t.Errorf("endpoints of a plaintext mesh: %q", got)
	}
	write(Endpoints{Services: map[string]Endpoint{"orchestrator": {Addr: "127.0.0.1:1"}}, TLSDir: tlsDir})
	if got := c.tlsDir(); got != tlsDir {
		t.Errorf("endpoints of an mTLS mesh: %q, want %q", got, tlsDir)
	}
	c.insecure = true
	if got := c.tlsDir(); got != "" {
		t.Errorf("--insecure: %q", got)
	}
	if conn, err := c.dial(); err != nil {
		t.Error(err)
	} else {
		_ = conn.Close()
	}
	if _, err := clientCredentials(t.TempDir(), meshtls.Orchestrator); err == nil {
		t.Error("credentials from a directory without curfew-cli's certificate")
	}
}
