package meshtls

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"sync"

	"google.golang.org/grpc/credentials"
)

// ClientAuth says whether a server requires its callers' certificates.
type ClientAuth int

const (
	// RequireClientCert refuses the handshake of a caller without a certificate issued
	// by a trusted CA and carrying a mesh identity: the internal services (toolrunner,
	// subagent, modelproxy) serve mesh peers only. It is the zero value.
	RequireClientCert ClientAuth = iota
	// VerifyClientCertIfGiven asks for a certificate but serves callers without one; a
	// certificate given must verify and carry a mesh identity. For the orchestrator,
	// whose public API external callers reach without a mesh certificate; its Policy
	// decides, per method, what a caller without an identity may call.
	VerifyClientCertIfGiven
)

// String returns the name of a.
func (a ClientAuth) String() string {
	switch a {
	case RequireClientCert:
		return "RequireClientCert"
	case VerifyClientCertIfGiven:
		return "VerifyClientCertIfGiven"
	}
	return fmt.Sprintf("ClientAuth(%d)", int(a))
}

// ServerCredentials returns the transport credentials of a gRPC server of src's identity
// (grpc.Creds): TLS 1.3, src's current certificate, callers' certificates verified
// against src's current CAs as auth says and required to carry a mesh identity. Each
// handshake takes src's state at its start, so rotated files apply to new connections
// without a restart. Sessions are resumed (TLS 1.3 tickets), except across a change of
// src's files: each state has its own ticket keys, so that a client's next connection
// gets the new certificate.
func ServerCredentials(src *Source, auth ClientAuth) credentials.TransportCredentials {
	ca := tls.RequireAndVerifyClientCert
	if auth == VerifyClientCertIfGiven {
		ca = tls.VerifyClientCertIfGiven
	}
	return &reloading{src: src, config: func(snap *snapshot) *tls.Config {
		return &tls.Config{
			MinVersion:       tls.VersionTLS13,
			Certificates:     []tls.Certificate{*snap.pair},
			ClientCAs:        snap.pool,
			ClientAuth:       ca,
			VerifyConnection: verifyClient,
		}
	}}
}

// verifyClient refuses a client certificate, verified by crypto/tls against the CAs,
// that carries no mesh identity.
func verifyClient(cs tls.ConnectionState) error {
	if len(cs.PeerCertificates) == 0 {
		return nil // allowed by VerifyClientCertIfGiven; RequireAndVerifyClientCert refused it
	}
	if len(cs.VerifiedChains) == 0 {
		return errors.New("meshtls: client certificate not verified")
	}
	if _, ok := identityOf(cs.VerifiedChains[0][0]); !ok {
		return fmt.Errorf("meshtls: client certificate carries no spiffe://%s/ identity", TrustDomain)
	}
	return nil
}

// sessionCacheSize is the number of TLS sessions a client keeps per server address.
const sessionCacheSize = 32

// ClientCredentials returns the transport credentials of a gRPC client of src's identity
// dialling the mesh service server (grpc.WithTransportCredentials): TLS 1.3, src's
// current certificate as the client certificate, and the server's certificate verified
// against src's current CAs and required to carry server's identity
// (spiffe://curfew.local/<server>); the host name dialled is not checked, so any
// address of the service will do (a Kubernetes Service name, an IP). Each handshake
// takes src's state at its start. Sessions are resumed, except across a change of src's
// files (each state has its own session cache), so that the server sees a rotated
// client certificate on the next connection.
func ClientCredentials(src *Source, server string) credentials.TransportCredentials {
	want := idURI(server).String()
	return &reloading{src: src, config: func(snap *snapshot) *tls.Config {
		return &tls.Config{
			MinVersion: tls.VersionTLS13,
			// Host name verification is off; VerifyConnection does the whole verification
			// instead: the chain against the mesh CAs and the server's identity rather
			// than the name dialled.
			InsecureSkipVerify: true, //nolint:gosec // VerifyConnection below verifies the chain and the peer's identity
			VerifyConnection: func(cs tls.ConnectionState) error {
				return verifyServer(cs, snap.pool, server, want)
			},
			GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
				return snap.pair, nil
			},
			ClientSessionCache: tls.NewLRUClientSessionCache(sessionCacheSize),
		}
	}}
}

// verifyServer verifies a server's certificate chain against roots and its identity.
func verifyServer(cs tls.ConnectionState, roots *x509.CertPool, server, want string) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("meshtls: server sent no certificate")
	}
	opts := x509.VerifyOptions{
		Roots:         roots,
		Intermediates: x509.NewCertPool(),
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, c := range cs.PeerCertificates[1:] {
		opts.Intermediates.AddCert(c)
	}
	leaf := cs.PeerCertificates[0]
	if _, err := leaf.Verify(opts); err != nil {
		return fmt.Errorf("meshtls: server certificate: %w", err)
	}
	if id, ok := identityOf(leaf); !ok || id != server {
		got := "no mesh identity"
		if ok {
			got = idURI(id).String()
		}
		return fmt.Errorf("meshtls: server is %s, want %s", got, want)
	}
	return nil
}

// reloading is gRPC's TLS credentials over a Source: one credentials.NewTLS per state
// of the Source, made by config at the first handshake that sees the state. A handshake
// uses one state from start to end, its session cache or ticket keys included.
type reloading struct {
	src    *Source
	config func(*snapshot) *tls.Config

	mu   sync.Mutex
	snap *snapshot
	tc   credentials.TransportCredentials
}

func (r *reloading) current() credentials.TransportCredentials {
	snap := r.src.current()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.snap != snap {
		r.snap, r.tc = snap, credentials.NewTLS(r.config(snap))
	}
	return r.tc
}

// ClientHandshake implements credentials.TransportCredentials.
func (r *reloading) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return r.current().ClientHandshake(ctx, authority, conn)
}

// ServerHandshake implements credentials.TransportCredentials.
func (r *reloading) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return r.current().ServerHandshake(conn)
}

// Info implements credentials.TransportCredentials.
func (r *reloading) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "tls"}
}

// Clone implements credentials.TransportCredentials.
func (r *reloading) Clone() credentials.TransportCredentials {
	return &reloading{src: r.src, config: r.config}
}

// OverrideServerName implements credentials.TransportCredentials. It does nothing: a
// mesh client checks the server's identity, not its name.
//
// Deprecated: as in package credentials.
func (r *reloading) OverrideServerName(string) error { return nil }
