package cli

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/curfew-mesh/curfew/internal/launch"
)

// The client commands take mTLS from endpoints.json for its own orchestrator, else from
// DIR/tls, and plaintext with --insecure or without either.
func TestClientTLSDir(t *testing.T) {
	data := t.TempDir()
	c := &common{dataDir: data}
	if got := c.tlsDir(); got != "" {
		t.Errorf("no endpoints, no DIR/tls: %q, want plaintext", got)
	}
	tlsDir, err := launch.PrepareTLS(filepath.Join(data, launch.TLSSubdir))
	if err != nil {
		t.Fatal(err)
	}
	if got := c.tlsDir(); got != filepath.Join(data, launch.TLSSubdir) {
		t.Errorf("DIR/tls without endpoints: %q", got)
	}
	write := func(e Endpoints) {
		b, _ := json.Marshal(e)
		if err := os.WriteFile(filepath.Join(data, EndpointsFile), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(Endpoints{Services: map[string]launch.Endpoint{"orchestrator": {Addr: "127.0.0.1:1"}}}) // curfew up --insecure
	if got := c.tlsDir(); got != "" {
		t.Errorf("endpoints of a plaintext mesh: %q", got)
	}
	write(Endpoints{Services: map[string]launch.Endpoint{"orchestrator": {Addr: "127.0.0.1:1"}}, TLSDir: tlsDir})
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
}
