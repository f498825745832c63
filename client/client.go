package client

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// Client is a connection to an orchestrator. It is safe for concurrent use; Close it when
// done.
type Client struct {
	conn *grpc.ClientConn
	rpc  orchestratorv1.OrchestratorServiceClient
}

// An Option configures New.
type Option func(*options)

type options struct {
	apiKey     string
	tlsConfig  *tls.Config
	meshDir    string
	meshID     string
	insecure   bool
	noRetry    bool
	logger     *slog.Logger
	dialOpts   []grpc.DialOption
	transports int // how many of WithTLS, WithMeshTLS and WithInsecure were given
}

// WithAPIKey sends key, a tenant's API key (cfk_…), as "authorization: Bearer" on every
// call; the calls then act for the key's tenant. Over plaintext (WithInsecure) the key is
// sent only to a loopback target (localhost, 127.0.0.0/8, ::1, or a unix socket): New
// refuses any other target rather than send a secret in the clear.
func WithAPIKey(key string) Option { return func(o *options) { o.apiKey = key } }

// WithTLS connects over TLS with cfg (for example RootCAs holding the mesh's ca.crt, and
// ServerName "orchestrator", a DNS name every orchestrator certificate carries). A nil cfg
// is TLS with the system's roots, as without any transport option.
func WithTLS(cfg *tls.Config) Option {
	return func(o *options) { o.tlsConfig, o.transports = cfg, o.transports+1 }
}

// WithMeshTLS connects over mTLS as the mesh identity whose files are in dir
// (<identity>.crt, <identity>.key and ca.crt, as `curfew up` writes them to DATA_DIR/tls;
// "curfew-cli" is the operators' identity). The server must present the orchestrator's
// mesh identity; the host name dialled is not checked. Rotated files are picked up
// without a restart (package mesh/meshtls).
func WithMeshTLS(dir, identity string) Option {
	return func(o *options) { o.meshDir, o.meshID, o.transports = dir, identity, o.transports+1 }
}

// WithInsecure connects in plaintext, to a mesh started with `curfew up --insecure`.
func WithInsecure() Option {
	return func(o *options) { o.insecure, o.transports = true, o.transports+1 }
}

// WithDialOptions adds grpc.DialOptions after the client's own (interceptors are chained
// inside the retry layer, so they see every attempt).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOpts = append(o.dialOpts, opts...) }
}

// WithLogger receives a record per retried attempt; none are logged by default.
func WithLogger(l *slog.Logger) Option { return func(o *options) { o.logger = l } }

// WithoutRetries turns the client's retries off: every call makes one attempt (it still
// carries a retry-id).
func WithoutRetries() Option { return func(o *options) { o.noRetry = true } }

// New returns a client of the orchestrator at target ("host:port", or any gRPC target
// such as "dns:///orchestrator:7700"). It does not connect: the first call does.
//
// Transport: TLS with the system's roots by default; WithTLS, WithMeshTLS or WithInsecure
// choose another (at most one of them). Retries: on by default, as package doc describes.
func New(target string, opts ...Option) (*Client, error) {
	o := options{logger: slog.New(slog.DiscardHandler)}
	for _, opt := range opts {
		opt(&o)
	}
	if o.transports > 1 {
		return nil, errors.New("client: give at most one of WithTLS, WithMeshTLS and WithInsecure")
	}
	var creds credentials.TransportCredentials
	switch {
	case o.insecure:
		if o.apiKey != "" && !isLoopback(target) {
			return nil, fmt.Errorf("client: WithAPIKey over plaintext (WithInsecure) to %q: the key would cross the network in the clear; use TLS, or a loopback target", target)
		}
		creds = insecure.NewCredentials()
	case o.meshDir != "":
		src, err := meshtls.NewSource(o.meshDir, o.meshID, meshtls.WithLogger(o.logger))
		if err != nil {
			return nil, fmt.Errorf("client: WithMeshTLS: %w", err)
		}
		creds = meshtls.ClientCredentials(src, meshtls.Orchestrator)
	case o.tlsConfig != nil:
		creds = credentials.NewTLS(o.tlsConfig)
	default:
		creds = credentials.NewTLS(&tls.Config{MinVersion: tls.VersionTLS12})
	}
	dial := append([]grpc.DialOption{grpc.WithTransportCredentials(creds)}, mesh.DialOptions(mesh.ClientConfig{Retry: retryConfig(o)})...)
	if o.apiKey != "" {
		dial = append(dial, grpc.WithPerRPCCredentials(apikey.Bearer(o.apiKey)))
	}
	conn, err := grpc.NewClient(target, append(dial, o.dialOpts...)...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, rpc: orchestratorv1.NewOrchestratorServiceClient(conn)}, nil
}

// methodStartRun is retried only with an idempotency key: without one a retry could start
// a second run.
const methodStartRun = "/curfew.orchestrator.v1.OrchestratorService/StartRun"

// retryConfig is the policy of docs/retries.md for an outside caller: the mesh's defaults
// (UNAVAILABLE, and RESOURCE_EXHAUSTED with pushback; at most 3 attempts; streams only
// before their first message; never an error marked RETRIES_EXHAUSTED), StartRun only
// with a key.
func retryConfig(o options) retry.Config {
	return retry.Config{
		Target:  meshtls.Orchestrator,
		Default: retry.Policy{Disabled: o.noRetry},
		Methods: map[string]retry.Policy{methodStartRun: {Disabled: o.noRetry, NonIdempotent: true}},
		Logger:  o.logger,
	}
}

// isLoopback reports whether target names only this machine: a unix socket, localhost,
// or a loopback IP.
func isLoopback(target string) bool {
	if strings.HasPrefix(target, "unix:") || strings.HasPrefix(target, "unix-abstract:") {
		return true
	}
	for _, scheme := range []string{"dns:///", "passthrough:///"} {
		target = strings.TrimPrefix(target, scheme)
	}
	host, _, err := net.SplitHostPort(target)
	if err != nil {
		host = target
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Close closes the connection. Calls in flight fail with CANCELLED; a Run in flight is
// cancelled (cause client_disconnect) unless it was asked to continue.
func (c *Client) Close() error { return c.conn.Close() }

// Conn returns the client's connection, for the other services of the orchestrator
// (DeadLetterService) or health checks. Its calls go through the same retry layer.
func (c *Client) Conn() *grpc.ClientConn { return c.conn }
