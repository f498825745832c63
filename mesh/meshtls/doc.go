// Package meshtls is curfew's mutual TLS: a local certificate authority that issues
// one certificate per service, transport credentials that reload rotated certificates
// without a restart, the caller's identity taken from its certificate, and an
// authorization policy by method that encodes curfew's call graph.
//
// # Identities
//
// Every process of the mesh has an identity: orchestrator, toolrunner, subagent,
// modelproxy, and curfew-cli for the command line and operators' tools. A certificate
// carries it as a SPIFFE-style URI SAN in curfew's trust domain:
//
//	spiffe://curfew.local/<identity>
//
// Only that URI counts. Certificates also carry the DNS SANs localhost and <identity> and
// the IP SANs 127.0.0.1 and ::1 (plus any hosts given to CA.Issue), for tools that check
// a host name (grpcurl, grpc-health-probe), but curfew's clients ignore host names: a
// client dialling toolrunner accepts a server certificate that chains to the mesh CA and
// carries spiffe://curfew.local/toolrunner, whatever the address dialled.
//
// # Files
//
// One directory (under curfew up's data directory) holds:
//
//	ca.crt            the trusted CAs, PEM (0644): the CA's certificate first, then,
//	                  during a CA rotation, the previous CAs still trusted
//	ca.key            the CA's private key, PKCS #8 PEM (0600); only curfew up reads it
//	<identity>.crt    an identity's certificate, PEM (0644), optionally followed by
//	                  intermediates
//	<identity>.key    its private key, PKCS #8 or SEC 1 PEM (0600)
//
// EnsureCA creates the CA (or loads it) and CA.Issue writes an identity's pair. Every file
// is replaced atomically (a temporary file and a rename). Keys are ECDSA P-256; the CA is
// valid for DefaultCAValidity, certificates for DefaultCertValidity, both from ClockSkew
// before their issue.
//
// # Reloading
//
// A Source serves one identity's pair and ca.crt from the directory. A handshake looks at
// the files when DefaultReloadInterval (WithReloadInterval) has passed since the last
// look, so a change is in use by every handshake that begins one interval after it; no
// goroutine polls. A bad state of the files (a pair half written, a file that does not
// parse, the certificate of another identity) keeps the last good one, logs a warning
// and counts in Stats. Established connections are not affected by a change. The look
// follows symbolic links, so the atomic update of a Kubernetes Secret volume (a swap of
// its ..data link) is seen too.
//
// A rotation of a service's certificate is CA.Issue: nothing restarts and no call fails.
// A rotation of the CA needs a transition, since a peer that does not yet trust the new
// CA would refuse a certificate it issued: RotateCA (ca.crt holds the new CA and the old
// one), wait more than the reload interval, CA.Issue every identity, wait again, then
// CA.FinishRotation (ca.crt holds the new CA only).
//
// # Credentials
//
// ServerCredentials and ClientCredentials are gRPC transport credentials over a Source:
// TLS 1.3 only, the Source's current certificate and CAs at each handshake, session
// resumption on (and reset when the certificates change, so a new connection presents the
// new ones). A server either requires a client certificate (RequireClientCert: toolrunner,
// subagent, modelproxy) or verifies one if given (VerifyClientCertIfGiven: the
// orchestrator, whose public API takes external callers). A client verifies the server's
// identity (ClientCredentials' server argument).
//
// # Authorization
//
// PeerIdentity returns a server call's caller identity. A Policy's interceptors refuse a
// call whose caller the call graph does not allow: PERMISSION_DENIED ("subagent may not
// call /curfew.subagent.v1.SubagentService/Spawn") for a mesh peer,
// UNAUTHENTICATED for a caller without a mesh identity on a method that needs one.
// DefaultPolicy(server) is this table (the services' clients in
// services/*/cmd/*/main.go; ../shared/DESIGN.md, "The four services"):
//
//	server        methods                                      callers
//	orchestrator  curfew.orchestrator.v1.OrchestratorService/*  public (no certificate needed)
//	              curfew.orchestrator.v1.DeadLetterService/*    public (no certificate needed)
//	              curfew.admin.v1.AdminService/*                public here; the orchestrator's admin
//	                                                           authorizer admits curfew-cli and keys
//	                                                           with an operator scope
//	toolrunner    curfew.toolrunner.v1.ToolRunnerService/*      orchestrator, subagent
//	              curfew.mesh.v1.NodeReportService/*            orchestrator, subagent
//	              curfew.mesh.v1.NodeReportService/ListNodes    curfew-cli
//	subagent      curfew.subagent.v1.SubagentService/*          toolrunner (spawn_subagent)
//	              curfew.mesh.v1.NodeReportService/*            orchestrator, toolrunner
//	              curfew.mesh.v1.NodeReportService/ListNodes    curfew-cli
//	modelproxy    curfew.modelproxy.v1.ModelProxyService/       orchestrator, subagent
//	                Generate, RenewLeases, ListModels
//	              curfew.modelproxy.v1.ModelProxyService/       orchestrator (the admin API's
//	                ListDecoders, CancelDecoders                 fan-out to every replica)
//	              curfew.mesh.v1.NodeReportService/*            orchestrator, subagent
//	              curfew.mesh.v1.NodeReportService/ListNodes    curfew-cli
//	every server  grpc.health.v1.Health/*, grpc.reflection.*    any mesh identity
//
// Everything else is refused. A server without TLS (curfew up --insecure) has no caller
// identities, so it must not install a Policy.
package meshtls

import "time"

// Defaults and file names.
const (
	// TrustDomain is curfew's SPIFFE trust domain: identities are
	// spiffe://curfew.local/<identity>.
	TrustDomain = "curfew.local"
	// CACertFile and CAKeyFile are the CA's file names in a directory.
	CACertFile = "ca.crt"
	CAKeyFile  = "ca.key"
	// DefaultCAValidity is how long a CA made by EnsureCA or RotateCA is valid: 10
	// years, for a local mesh whose CA lives as long as its data directory.
	DefaultCAValidity = 10 * 365 * 24 * time.Hour
	// DefaultCertValidity is how long an identity's certificate is valid when CA.Issue is
	// given no validity: 90 days. Re-issuing it (CA.Issue again) is a rotation.
	DefaultCertValidity = 90 * 24 * time.Hour
	// ClockSkew is how long before its issue a certificate is valid, so that a peer
	// whose clock is a little behind accepts it.
	ClockSkew = 5 * time.Minute
	// DefaultReloadInterval is how often, at most, a Source looks at its files.
	DefaultReloadInterval = time.Second
)
