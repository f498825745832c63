package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// tlsState is a service's mTLS (--tls-dir): its identity's Source, whose files reload on
// rotation, and its server's Policy. nil on a plaintext service.
type tlsState struct {
	src    *meshtls.Source
	policy *meshtls.Policy
}

// validateTLS checks the transport flags: exactly one of --tls-dir and --insecure.
func (o *Options) validateTLS() error {
	if o.TLSDir != "" && o.Insecure {
		return errors.New("--tls-dir and --insecure are exclusive: give --tls-dir for mTLS, or --insecure for plaintext (local debugging only)")
	}
	return nil
}

// requireTransport refuses options that say neither --tls-dir nor --insecure: mTLS is
// the default, so plaintext must be asked for. Checked last by Validate, so that the
// other flags' errors come first.
func (o *Options) requireTransport() error {
	if o.TLSDir == "" && !o.Insecure {
		return errors.New("mTLS is required: give --tls-dir DIR (ca.crt and <service>.crt/.key, as curfew up writes them under its data directory), or --insecure for plaintext, only for local debugging")
	}
	return nil
}

// newTLS loads the service's certificate and its call-graph policy from --tls-dir, and
// registers the TLS metrics; nil, nil without --tls-dir. The identity is the service's
// name.
func newTLS(o Options, log *slog.Logger, reg prometheus.Registerer) (*tlsState, error) {
	if o.TLSDir == "" { // --insecure (Validate refuses neither)
		log.Warn("mTLS is off (--insecure): calls are plaintext and unauthenticated, and every caller may call every method; use this only for local debugging")
		return nil, nil
	}
	src, err := meshtls.NewSource(o.TLSDir, o.Name, meshtls.WithLogger(log))
	if err != nil {
		return nil, fmt.Errorf("--tls-dir: %w", err)
	}
	pol, err := meshtls.DefaultPolicy(o.Name)
	if err != nil {
		return nil, fmt.Errorf("--tls-dir: %w", err)
	}
	reg.MustRegister(
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "curfew_tls_reload_errors_total",
			Help: "Failed reloads of this service's certificate, key or ca.crt from --tls-dir: each bad state of the files once; the previous certificates stay in use.",
		}, func() float64 { return float64(src.Stats().Errors) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "curfew_tls_cert_expiry_timestamp_seconds",
			Help: "Expiry (NotAfter, Unix seconds) of the certificate this service currently presents.",
		}, func() float64 { return float64(src.Certificate().NotAfter.Unix()) }),
	)
	log.Info("mTLS is on", "tls_dir", o.TLSDir, "identity", o.Name, "serial", fmt.Sprintf("%x", src.Certificate().SerialNumber))
	return &tlsState{src: src, policy: pol}, nil
}

// serverCreds returns the gRPC server's transport credentials: mTLS with --tls-dir
// (client certificates required, except on the orchestrator, whose public API takes
// callers without one), else nil (plaintext).
func (t *tlsState) serverCreds(name string) credentials.TransportCredentials {
	if t == nil {
		return nil
	}
	auth := meshtls.RequireClientCert
	if name == meshtls.Orchestrator {
		auth = meshtls.VerifyClientCertIfGiven
	}
	return meshtls.ServerCredentials(t.src, auth)
}

// authorize is the server chain's authorization (mesh.ServerConfig.Authorize): the
// policy's, or none on a plaintext service.
func (t *tlsState) authorize() func(context.Context, string) error {
	if t == nil {
		return nil
	}
	return t.policy.Authorize
}

// TLS returns the service's mTLS Source (its certificate, reloaded on rotation), or nil
// when it runs plaintext.
func (rt *Runtime) TLS() *meshtls.Source {
	if rt.tls == nil {
		return nil
	}
	return rt.tls.src
}

// Credentials returns the transport credentials of this service's connections to the
// mesh service server (an identity: meshtls.ToolRunner, ...): mTLS with this service's
// certificate, verifying the server's identity, with --tls-dir; plaintext without.
func (rt *Runtime) Credentials(server string) credentials.TransportCredentials {
	if rt.tls == nil {
		return insecure.NewCredentials()
	}
	return meshtls.ClientCredentials(rt.tls.src, server)
}
