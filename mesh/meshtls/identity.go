package meshtls

import (
	"context"
	"crypto/x509"
	"fmt"
	"net/url"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
)

// Identities of curfew's four services and of its command line. A mesh identity is a
// DNS label; its certificate carries it as the URI SAN spiffe://curfew.local/<identity>.
const (
	Orchestrator = "orchestrator"
	ToolRunner   = "toolrunner"
	Subagent     = "subagent"
	ModelProxy   = "modelproxy"
	// CLI is the identity of the curfew command and of operators' tools (e2e tests
	// too): it calls the orchestrator's public API and reads the services' node tables.
	CLI = "curfew-cli"
)

// idURI returns the URI SAN of identity: spiffe://curfew.local/<identity>.
func idURI(identity string) *url.URL {
	return &url.URL{Scheme: "spiffe", Host: TrustDomain, Path: "/" + identity}
}

// validIdentity reports whether id can be a mesh identity: a DNS label (1 to 63 of
// a-z, 0-9 and '-', neither first nor last a '-'), since it is also a DNS SAN and a
// file name.
func validIdentity(id string) bool {
	if id == "" || len(id) > 63 || id[0] == '-' || id[len(id)-1] == '-' {
		return false
	}
	for _, c := range id {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

func checkIdentity(id string) error {
	if !validIdentity(id) {
		return fmt.Errorf("meshtls: identity %q is not a DNS label (a-z, 0-9, '-'; at most 63)", id)
	}
	return nil
}

// identityOf returns the mesh identity in cert's URI SANs: exactly one URI in the trust
// domain, spiffe://curfew.local/<identity>, with a valid identity. Other URIs are ignored.
func identityOf(cert *x509.Certificate) (string, bool) {
	id, n := "", 0
	for _, u := range cert.URIs {
		if u.Scheme != "spiffe" || u.Host != TrustDomain {
			continue
		}
		n++
		if u.Opaque != "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" ||
			len(u.Path) < 2 || u.Path[0] != '/' || !validIdentity(u.Path[1:]) {
			return "", false
		}
		id = u.Path[1:]
	}
	if n != 1 {
		return "", false
	}
	return id, true
}

// PeerIdentity returns the mesh identity of the caller of a server call: the identity in
// the URI SAN of the client certificate that the server verified against the mesh CA
// (package doc). It is false for a caller without a certificate, over a plaintext
// connection, or whose certificate carries no identity in curfew's trust domain. It is
// meant for servers built with ServerCredentials; on a client connection, whose server
// certificate ClientCredentials verifies itself, it is always false.
func PeerIdentity(ctx context.Context) (string, bool) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return "", false
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return "", false
	}
	return identityOf(info.State.VerifiedChains[0][0])
}
