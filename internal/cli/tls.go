package cli

import (
	"os"
	"path/filepath"

	"github.com/curfew-mesh/curfew/internal/launch"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// insecureWarning is what `curfew up --insecure` prints.
const insecureWarning = "curfew up: WARNING: --insecure: the services run plaintext without mTLS, so any process that reaches their ports may call any method; use this only for local debugging"

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
	dir := filepath.Join(c.dataDir, launch.TLSSubdir)
	if _, err := os.Stat(filepath.Join(dir, meshtls.CLI+".crt")); err == nil {
		return dir
	}
	return ""
}
