package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// TLSSubdir is the directory of the mesh's mTLS files under the data directory.
const TLSSubdir = "tls"

// insecureWarning is what `curfew up --insecure` prints.
const insecureWarning = "curfew up: WARNING: --insecure: the services run plaintext without mTLS, so any process that reaches their ports may call any method; use this only for local debugging"

// meshIdentities are the identities `curfew up` issues certificates to.
var meshIdentities = []string{meshtls.Orchestrator, meshtls.ToolRunner, meshtls.Subagent, meshtls.ModelProxy, meshtls.CLI}

// prepareTLS creates the mesh CA in dir (or loads the one there) and issues a fresh
// certificate to every identity: each start of `curfew up` is a rotation of the
// services' certificates. It returns dir made absolute.
func prepareTLS(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	return abs, issueMesh(abs, nil, 0)
}

// issueMesh makes or loads the CA in dir (EnsureCA, which creates dir) and issues every
// identity's certificate, valid for validFor (meshtls.DefaultCertValidity when 0); the
// orchestrator's also names hosts. `curfew up`, `curfew drill` and `curfew tls init` all
// issue through it.
func issueMesh(dir string, hosts []string, validFor time.Duration) error {
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		return err
	}
	for _, id := range meshIdentities {
		var h []string
		if id == meshtls.Orchestrator {
			h = hosts
		}
		if err := ca.Issue(dir, id, validFor, h...); err != nil {
			return err
		}
	}
	return nil
}

// tlsDir is the directory of mTLS files the client commands use, "" for plaintext:
// --insecure says plaintext; else endpoints.json of a running `curfew up` says whether
// its mesh runs mTLS, when the orchestrator dialled is its own; else DIR/tls is used when
// it holds the CLI's certificate.
func (c *common) tlsDir() string {
	if c.insecure {
		return ""
	}
	if eps, err := readEndpoints(c.dataDir); err == nil {
		if e, ok := eps.Services["orchestrator"]; ok && (c.addr == "" || c.addr == e.Addr) {
			return eps.TLSDir
		}
	}
	dir := filepath.Join(c.dataDir, TLSSubdir)
	if _, err := os.Stat(filepath.Join(dir, meshtls.CLI+".crt")); err == nil {
		return dir
	}
	return ""
}

// clientCredentials returns curfew-cli's credentials for server from the mTLS files in
// dir, or plaintext when dir is "".
func clientCredentials(dir, server string) (credentials.TransportCredentials, error) {
	if dir == "" {
		return insecure.NewCredentials(), nil
	}
	src, err := meshtls.NewSource(dir, meshtls.CLI)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("the mesh runs mTLS but %s has no curfew-cli certificate (restart curfew up, or pass --insecure to a plaintext mesh): %w", dir, err)
		}
		return nil, err
	}
	return meshtls.ClientCredentials(src, server), nil
}
