package meshtls_test

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

func TestEnsureCACreatesThenLoads(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data", "tls")
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]os.FileMode{meshtls.CAKeyFile: 0o600, meshtls.CACertFile: 0o644} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s mode = %v, want %v", name, fi.Mode().Perm(), want)
		}
	}
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("directory: %v, %v; want mode 0700", fi.Mode(), err)
	}
	c := ca.Certificate()
	if !c.IsCA || !c.MaxPathLenZero || c.PublicKeyAlgorithm != x509.ECDSA {
		t.Errorf("CA certificate: IsCA %v, MaxPathLenZero %v, key %v", c.IsCA, c.MaxPathLenZero, c.PublicKeyAlgorithm)
	}
	if life := c.NotAfter.Sub(c.NotBefore); life != meshtls.DefaultCAValidity+meshtls.ClockSkew {
		t.Errorf("CA validity = %v", life)
	}
	again, err := meshtls.EnsureCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !again.Certificate().Equal(c) {
		t.Error("EnsureCA of an existing CA made a new one")
	}
}

func TestEnsureCARefusesHalfACA(t *testing.T) {
	for _, keep := range []string{meshtls.CACertFile, meshtls.CAKeyFile} {
		dir := t.TempDir()
		if _, err := meshtls.EnsureCA(dir); err != nil {
			t.Fatal(err)
		}
		other := meshtls.CACertFile
		if keep == other {
			other = meshtls.CAKeyFile
		}
		if err := os.Remove(filepath.Join(dir, other)); err != nil {
			t.Fatal(err)
		}
		if _, err := meshtls.EnsureCA(dir); err == nil || !strings.Contains(err.Error(), "only one of") {
			t.Errorf("with only %s: err = %v, want one naming the half CA", keep, err)
		}
	}
	// A key that is not the certificate's.
	dir, other := t.TempDir(), t.TempDir()
	for _, d := range []string{dir, other} {
		if _, err := meshtls.EnsureCA(d); err != nil {
			t.Fatal(err)
		}
	}
	b, _ := os.ReadFile(filepath.Join(other, meshtls.CAKeyFile))
	if err := os.WriteFile(filepath.Join(dir, meshtls.CAKeyFile), b, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := meshtls.EnsureCA(dir); err == nil {
		t.Error("EnsureCA took a key that is not its certificate's")
	}
}

func TestIssue(t *testing.T) {
	m := newMesh(t)
	if err := m.ca.Issue(m.dir, meshtls.ToolRunner, time.Hour, "toolrunner.curfew.svc", "10.0.0.7"); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]os.FileMode{"toolrunner.key": 0o600, "toolrunner.crt": 0o644} {
		fi, err := os.Stat(filepath.Join(m.dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s mode = %v, want %v", name, fi.Mode().Perm(), want)
		}
	}
	leftovers, _ := filepath.Glob(filepath.Join(m.dir, ".*"))
	if len(leftovers) > 0 {
		t.Errorf("temporary files left: %v", leftovers)
	}
	leaf := m.leaf(t, meshtls.ToolRunner)
	if len(leaf.URIs) != 1 || leaf.URIs[0].String() != "spiffe://curfew.local/toolrunner" {
		t.Errorf("URIs = %v", leaf.URIs)
	}
	if want := []string{"localhost", "toolrunner", "toolrunner.curfew.svc"}; !slices.Equal(leaf.DNSNames, want) {
		t.Errorf("DNSNames = %v, want %v", leaf.DNSNames, want)
	}
	var ips []string
	for _, ip := range leaf.IPAddresses {
		ips = append(ips, ip.String())
	}
	if want := []string{"127.0.0.1", "::1", "10.0.0.7"}; !slices.Equal(ips, want) {
		t.Errorf("IPAddresses = %v, want %v", ips, want)
	}
	if life := leaf.NotAfter.Sub(leaf.NotBefore); life != time.Hour+meshtls.ClockSkew {
		t.Errorf("validity = %v, want 1h + ClockSkew", life)
	}
	roots := x509.NewCertPool()
	roots.AddCert(m.ca.Certificate())
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			t.Errorf("verify for usage %v: %v", usage, err)
		}
	}
	for _, host := range []string{"localhost", "127.0.0.1", "::1", "toolrunner"} {
		if err := leaf.VerifyHostname(host); err != nil {
			t.Errorf("VerifyHostname(%s): %v", host, err)
		}
	}

	// The default validity, capped by the CA's.
	m.issue(t, meshtls.Subagent)
	if left := time.Until(m.leaf(t, meshtls.Subagent).NotAfter); left > meshtls.DefaultCertValidity || left < meshtls.DefaultCertValidity-time.Minute {
		t.Errorf("default validity left = %v, want about %v", left, meshtls.DefaultCertValidity)
	}
	if err := m.ca.Issue(m.dir, meshtls.Subagent, 100*365*24*time.Hour); err != nil {
		t.Fatal(err)
	}
	if got := m.leaf(t, meshtls.Subagent).NotAfter; !got.Equal(m.ca.Certificate().NotAfter) {
		t.Errorf("NotAfter = %v, want the CA's %v", got, m.ca.Certificate().NotAfter)
	}

	for _, bad := range []string{"", "Toolrunner", "tool_runner", "-x", "x-", "../x", strings.Repeat("a", 64)} {
		if err := m.ca.Issue(m.dir, bad, 0); err == nil {
			t.Errorf("Issue(%q) took an invalid identity", bad)
		}
	}
}
