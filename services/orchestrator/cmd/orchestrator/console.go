package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/services/orchestrator/internal/console"
	"google.golang.org/grpc"
)

// consoleFlags are the web console's flags (docs/console.md).
type consoleFlags struct {
	addr, cert, key, secretFile, tokenFile, traceURL string
	behindTLS                                        bool
	sessionTTL                                       time.Duration
}

func (f *consoleFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.addr, "console-addr", "", "address of the web console (docs/console.md): runs, a run's timeline live, cancel, approvals, health; off unless set. Anywhere but loopback it needs --console-tls-cert/--console-tls-key or --console-behind-tls-proxy")
	fs.StringVar(&f.cert, "console-tls-cert", "", "with --console-addr: PEM certificate the console serves HTTPS with (and --console-tls-key)")
	fs.StringVar(&f.key, "console-tls-key", "", "with --console-addr: PEM private key of --console-tls-cert")
	fs.BoolVar(&f.behindTLS, "console-behind-tls-proxy", false, "with --console-addr: the console is reached only through an ingress or proxy that terminates TLS, so it serves plain HTTP on a non-loopback address and marks its cookies Secure")
	fs.StringVar(&f.secretFile, "console-secret-file", "", "with --console-addr: file of the secret (at least 32 bytes) that seals the console's sessions; the same on every replica so that any replica serves any session. Default: a random one per process (sessions then last until it restarts and hold on this replica only)")
	fs.StringVar(&f.tokenFile, "console-signin-token-file", "", "with --console-addr: file of a one-time sign-in token (`curfew up` writes one and prints the link): its first use at /signin/link?token=… signs the local operator in with a new admin key of tenant default")
	fs.StringVar(&f.traceURL, "console-trace-url", "", "with --console-addr: address of a run's trace in your tracing UI, {run_id} replaced by the run's id (a search by the curfew.run_id attribute); the run page links to it")
	fs.DurationVar(&f.sessionTTL, "console-session-ttl", console.DefaultSessionTTL, "with --console-addr: how long a console session lasts after sign-in")
}

// validate checks the flags before anything starts; a bad combination is a usage error.
func (f *consoleFlags) validate() error {
	if f.addr == "" {
		for name, v := range map[string]string{"--console-tls-cert": f.cert, "--console-tls-key": f.key, "--console-secret-file": f.secretFile, "--console-signin-token-file": f.tokenFile} {
			if v != "" {
				return fmt.Errorf("%s needs --console-addr", name)
			}
		}
		return nil
	}
	if (f.cert == "") != (f.key == "") {
		return errors.New("--console-tls-cert and --console-tls-key go together")
	}
	if f.cert != "" && f.behindTLS {
		return errors.New("--console-behind-tls-proxy is for a console without its own certificate: give it or --console-tls-cert, not both")
	}
	if f.sessionTTL < time.Minute {
		return errors.New("--console-session-ttl must be at least 1m")
	}
	host, _, err := net.SplitHostPort(f.addr)
	if err != nil {
		return fmt.Errorf("--console-addr: %w", err)
	}
	if f.cert == "" && !f.behindTLS && !loopbackHost(host) {
		return fmt.Errorf("--console-addr %s is not a loopback address: serve it with --console-tls-cert/--console-tls-key, or say --console-behind-tls-proxy when an ingress terminates TLS", f.addr)
	}
	return nil
}

func loopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// serveConsole serves the web console on f.addr. Its calls go to this orchestrator's own
// gRPC listener with the signed-in user's key, so they pass the same server chain as
// every client's. The returned func stops it (with the drain: its event streams end).
func serveConsole(ctx context.Context, rt *service.Runtime, f consoleFlags, st store.Store, keys *apikey.Authenticator, deadLetters bool) (func(), error) {
	secret, err := consoleSecret(f.secretFile)
	if err != nil {
		return nil, fmt.Errorf("--console-secret-file: %w", err)
	}
	if f.secretFile == "" {
		rt.Log.Warn("no --console-secret-file: console sessions are sealed with a random secret of this process, so they hold on this replica only and end when it restarts")
	}
	var token string
	if f.tokenFile != "" {
		b, err := os.ReadFile(f.tokenFile)
		if err != nil {
			return nil, fmt.Errorf("--console-signin-token-file: %w", err)
		}
		if token = strings.TrimSpace(string(b)); len(token) < 16 {
			return nil, errors.New("--console-signin-token-file: the token must be at least 16 characters")
		}
	}
	var tlsCfg *tls.Config
	if f.cert != "" {
		pair, err := tls.LoadX509KeyPair(f.cert, f.key)
		if err != nil {
			return nil, fmt.Errorf("--console-tls-cert/--console-tls-key: %w", err)
		}
		tlsCfg = &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	}
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", f.addr)
	if err != nil {
		return nil, err
	}
	cc, err := grpc.NewClient(loopback(rt.Addr()), grpc.WithTransportCredentials(rt.Credentials(meshtls.Orchestrator)))
	if err != nil {
		_ = lis.Close()
		return nil, err
	}
	cfg := console.Config{
		Orchestrator: orchestratorv1.NewOrchestratorServiceClient(cc),
		Admin:        adminv1.NewAdminServiceClient(cc),
		Store:        st, Keys: keys, Secret: secret, Secure: tlsCfg != nil || f.behindTLS,
		SignInToken: token, TraceURL: f.traceURL, SessionTTL: f.sessionTTL, Log: rt.Log,
	}
	if deadLetters {
		cfg.DeadLetters = orchestratorv1.NewDeadLetterServiceClient(cc)
	}
	h, err := console.New(cfg)
	if err != nil {
		_ = lis.Close()
		_ = cc.Close()
		return nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, TLSConfig: tlsCfg}
	go func() {
		var err error
		if tlsCfg != nil {
			err = srv.ServeTLS(lis, "", "")
		} else {
			err = srv.Serve(lis)
		}
		if err != nil && !errors.Is(err, http.ErrServerClosed) {
			rt.Log.Error("web console", "error", err.Error())
		}
	}()
	scheme := "http"
	if tlsCfg != nil {
		scheme = "https"
	}
	rt.Log.Info("web console listening", "console_addr", lis.Addr().String(), "url", scheme+"://"+lis.Addr().String()+"/")
	return func() {
		// Event streams last as long as their runs: the drain closes them (the browser
		// reconnects to another replica) rather than waiting.
		go func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			if err := srv.Shutdown(sctx); err != nil {
				_ = srv.Close()
			}
			_ = cc.Close()
		}()
	}, nil
}

// consoleSecret reads the sessions' secret from path, or makes a random one.
func consoleSecret(path string) ([]byte, error) {
	if path == "" {
		b := make([]byte, 32)
		_, err := rand.Read(b)
		return b, err
	}
	b, err := os.ReadFile(path) //nolint:gosec // the file the operator names with --console-secret-file
	if err != nil {
		return nil, err
	}
	b = []byte(strings.TrimSpace(string(b)))
	if len(b) < console.MinSecretLen {
		return nil, fmt.Errorf("%s holds %d bytes: the secret must be at least %d (openssl rand -base64 48)", path, len(b), console.MinSecretLen)
	}
	return b, nil
}
