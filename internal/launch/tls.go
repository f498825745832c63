package launch

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// TLSSubdir is the directory of the mesh's mTLS files under a data directory.
const TLSSubdir = "tls"

// Identities are the identities a mesh's certificates are issued to: the four services
// and curfew-cli.
var Identities = []string{meshtls.Orchestrator, meshtls.ToolRunner, meshtls.Subagent, meshtls.ModelProxy, meshtls.CLI}

// PrepareTLS creates the mesh CA in dir (or loads the one there) and issues a fresh
// certificate to every identity: each start of a mesh is a rotation of its services'
// certificates. It returns dir made absolute.
func PrepareTLS(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	return abs, IssueCerts(abs, nil, 0)
}

// IssueCerts makes or loads the CA in dir (meshtls.EnsureCA, which creates dir) and
// issues every identity's certificate, valid for validFor (meshtls.DefaultCertValidity
// when 0); the orchestrator's also names hosts.
func IssueCerts(dir string, hosts []string, validFor time.Duration) error {
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		return err
	}
	for _, id := range Identities {
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

// ClientCredentials returns curfew-cli's credentials for server from the mTLS files in
// dir, or plaintext when dir is "". log receives the certificate's load (slog.Default
// when nil).
func ClientCredentials(dir, server string, log *slog.Logger) (credentials.TransportCredentials, error) {
	if dir == "" {
		return insecure.NewCredentials(), nil
	}
	src, err := meshtls.NewSource(dir, meshtls.CLI, meshtls.WithLogger(log))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("the mesh runs mTLS but %s has no curfew-cli certificate (restart curfew up, or pass --insecure to a plaintext mesh): %w", dir, err)
		}
		return nil, err
	}
	return meshtls.ClientCredentials(src, server), nil
}
