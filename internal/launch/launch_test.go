package launch

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

func TestAllocateFreePorts(t *testing.T) {
	eps, err := Allocate(0)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for name, ep := range eps {
		for _, a := range []string{ep.Addr, ep.AdminAddr} {
			if seen[a] {
				t.Errorf("%s: address %s handed out twice", name, a)
			}
			seen[a] = true
		}
	}
	if len(seen) != 8 {
		t.Errorf("%d addresses, want 8", len(seen))
	}
	fixed, err := Allocate(7700)
	if err != nil {
		t.Fatal(err)
	}
	if fixed["orchestrator"].Addr != "127.0.0.1:7700" || fixed["modelproxy"].AdminAddr != "127.0.0.1:7707" {
		t.Errorf("fixed ports: %+v", fixed)
	}
}

// PrepareTLS keeps the CA across starts and re-issues every certificate (a rotation).
func TestPrepareTLSKeepsTheCAAndReissues(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "tls")
	abs, err := PrepareTLS(dir)
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
	for _, id := range Identities {
		if _, err := meshtls.NewSource(abs, id); err != nil {
			t.Errorf("%s: %v", id, err)
		}
	}
	if _, err := PrepareTLS(dir); err != nil {
		t.Fatal(err)
	}
	if read(meshtls.CACertFile) != ca {
		t.Error("a second start replaced the CA")
	}
	if read(meshtls.CLI+".crt") == cli {
		t.Error("a second start did not re-issue the certificates")
	}
}

// A mesh running mTLS needs curfew-cli's certificate.
func TestClientCredentialsWithoutTheCLICertificate(t *testing.T) {
	if _, err := ClientCredentials(t.TempDir(), meshtls.Orchestrator, nil); err == nil {
		t.Error("credentials from a directory without curfew-cli's certificate")
	}
}
