package apiserver

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"k8s.io/client-go/rest"

	"github.com/curfew-mesh/curfew/k8s/internal/proc"
)

// The environment variables that name the binaries when Options leaves them empty.
const (
	// EnvAPIServer names the kube-apiserver binary (scripts/kube-apiserver.sh prints it).
	EnvAPIServer = "CURFEW_KUBE_APISERVER"
	// EnvEtcd names the etcd binary (scripts/etcd.sh prints it).
	EnvEtcd = "CURFEW_ETCD"
)

// AdminUser is the user of the token in Server.Config; it is in the system:masters group,
// which the RBAC authorizer lets do everything.
const AdminUser = "curfew-admin"

// Options configures Start. The zero value takes the binaries from the environment.
type Options struct {
	// APIServer is the kube-apiserver binary; empty means $CURFEW_KUBE_APISERVER.
	APIServer string
	// Etcd is the etcd binary; empty means $CURFEW_ETCD.
	Etcd string
	// ReadyTimeout bounds the wait for each process to become ready (etcd's /health, then
	// the API server's /readyz); zero means 2 minutes, room for a loaded 2-core machine.
	ReadyTimeout time.Duration
	// ExtraArgs are added to kube-apiserver's flags (a later flag wins over an earlier one).
	ExtraArgs []string
	// Dir, when set, is where the certificates, credentials, etcd's data and the logs go,
	// and is not removed by Stop; empty means a new temporary directory that Stop removes.
	Dir string
}

// Server is a running etcd and kube-apiserver pair. Stop it when done.
type Server struct {
	// Config reaches the API server as AdminUser. It trusts the serving certificate that
	// the API server generated for itself in its certificate directory.
	Config *rest.Config
	// URL is the API server's address, https://127.0.0.1:PORT.
	URL string
	// EtcdURL is etcd's client address, http://127.0.0.1:PORT.
	EtcdURL string

	dir       string
	keepDir   bool
	etcd      *proc.Process
	apiserver *proc.Process
	stopOnce  sync.Once
	stopErr   error
}

// Start starts etcd and kube-apiserver on free loopback ports in a new temporary directory
// and returns once the API server reports ready. ctx bounds the start only: the processes
// run until Stop. On error nothing is left running and the directory is gone.
func Start(ctx context.Context, opts Options) (*Server, error) {
	if opts.APIServer == "" {
		opts.APIServer = os.Getenv(EnvAPIServer)
	}
	if opts.Etcd == "" {
		opts.Etcd = os.Getenv(EnvEtcd)
	}
	if opts.APIServer == "" {
		return nil, fmt.Errorf("apiserver: no kube-apiserver binary (set %s; scripts/kube-apiserver.sh builds it)", EnvAPIServer)
	}
	if opts.Etcd == "" {
		return nil, fmt.Errorf("apiserver: no etcd binary (set %s; scripts/etcd.sh installs it)", EnvEtcd)
	}
	if opts.ReadyTimeout <= 0 {
		opts.ReadyTimeout = 2 * time.Minute
	}
	dir, keep := opts.Dir, opts.Dir != ""
	if !keep {
		var err error
		if dir, err = os.MkdirTemp("", "curfew-apiserver-"); err != nil {
			return nil, fmt.Errorf("apiserver: %w", err)
		}
	} else if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("apiserver: %w", err)
	}
	s := &Server{dir: dir, keepDir: keep}
	if err := s.start(ctx, opts); err != nil {
		if stopErr := s.Stop(); stopErr != nil {
			err = errors.Join(err, stopErr)
		}
		return nil, err
	}
	return s, nil
}

// Stop ends the API server, then etcd (SIGTERM, then SIGKILL after a grace period), and
// removes the temporary directory (not a directory of Options.Dir). It may be called more
// than once.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		// The API server first, so that it does not log its lost store.
		s.apiserver.Stop()
		s.etcd.Stop()
		if !s.keepDir {
			s.stopErr = os.RemoveAll(s.dir)
		}
	})
	return s.stopErr
}

// Logs returns the last lines that etcd and the API server wrote, for failure messages.
func (s *Server) Logs() string {
	return "etcd:\n" + s.etcd.Tail() + "\nkube-apiserver:\n" + s.apiserver.Tail()
}

func (s *Server) start(ctx context.Context, opts Options) error {
	if err := s.startEtcd(ctx, opts); err != nil {
		return err
	}
	return s.startAPIServer(ctx, opts)
}

// attempts is how often a process is started again after losing the race for a port that
// was free when picked.
const attempts = 3

func (s *Server) startEtcd(ctx context.Context, opts Options) error {
	data := filepath.Join(s.dir, "etcd")
	var lastErr error
	for attempt := range attempts {
		ports, err := proc.FreePorts(ctx, 2)
		if err != nil {
			return err
		}
		client := "http://127.0.0.1:" + strconv.Itoa(ports[0])
		peer := "http://127.0.0.1:" + strconv.Itoa(ports[1])
		if err := os.RemoveAll(data); err != nil {
			return fmt.Errorf("apiserver: %w", err)
		}
		p, err := proc.Start(ctx, opts.Etcd, filepath.Join(s.dir, fmt.Sprintf("etcd-%d.log", attempt)),
			"--name=curfew-test",
			"--data-dir="+data,
			"--listen-client-urls="+client,
			"--advertise-client-urls="+client,
			"--listen-peer-urls="+peer,
			"--initial-advertise-peer-urls="+peer,
			"--initial-cluster=curfew-test="+peer,
			"--initial-cluster-state=new",
			"--logger=zap",
			"--log-outputs=stderr",
			"--log-level=warn",
		)
		if err != nil {
			return err
		}
		s.etcd = p
		s.EtcdURL = client
		httpClient := &http.Client{Timeout: 5 * time.Second}
		lastErr = p.WaitReady(ctx, opts.ReadyTimeout, func(ctx context.Context) error {
			return proc.GetOK(ctx, httpClient, client+"/health", "")
		})
		if lastErr == nil {
			return nil
		}
		p.Stop()
		if !p.LostPort() {
			break
		}
	}
	return fmt.Errorf("apiserver: etcd: %w", lastErr)
}

func (s *Server) startAPIServer(ctx context.Context, opts Options) error {
	token, err := s.writeCredentials()
	if err != nil {
		return err
	}
	certDir := filepath.Join(s.dir, "certs")
	var lastErr error
	for attempt := range attempts {
		ports, err := proc.FreePorts(ctx, 1)
		if err != nil {
			return err
		}
		url := "https://127.0.0.1:" + strconv.Itoa(ports[0])
		if err := os.RemoveAll(certDir); err != nil {
			return fmt.Errorf("apiserver: %w", err)
		}
		args := []string{
			"--etcd-servers=" + s.EtcdURL,
			"--bind-address=127.0.0.1",
			"--advertise-address=127.0.0.1",
			"--secure-port=" + strconv.Itoa(ports[0]),
			"--cert-dir=" + certDir,
			"--token-auth-file=" + filepath.Join(s.dir, "tokens.csv"),
			"--authorization-mode=Node,RBAC",
			"--service-account-key-file=" + filepath.Join(s.dir, "sa.pub"),
			"--service-account-signing-key-file=" + filepath.Join(s.dir, "sa.key"),
			"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
			"--api-audiences=https://kubernetes.default.svc.cluster.local",
			// Alone on loopback: no other API server to reconcile the kubernetes
			// Service's endpoints with, and 127.0.0.1 is not a valid endpoint address.
			"--endpoint-reconciler-type=none",
			"--service-cluster-ip-range=10.96.0.0/16",
			"--allow-privileged=true",
			"--profiling=false",
		}
		p, err := proc.Start(ctx, opts.APIServer, filepath.Join(s.dir, fmt.Sprintf("kube-apiserver-%d.log", attempt)),
			append(args, opts.ExtraArgs...)...)
		if err != nil {
			return err
		}
		s.apiserver = p
		s.URL = url
		// /readyz is polled without verifying the certificate: the API server writes it
		// to certDir while it starts, and only the process that just started serves here.
		insecure := &http.Client{
			Timeout:   10 * time.Second,
			Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, //nolint:gosec // loopback readiness probe, see above
		}
		lastErr = p.WaitReady(ctx, opts.ReadyTimeout, func(ctx context.Context) error {
			return proc.GetOK(ctx, insecure, url+"/readyz", token)
		})
		insecure.CloseIdleConnections()
		if lastErr == nil {
			break
		}
		p.Stop()
		if !p.LostPort() {
			return fmt.Errorf("apiserver: kube-apiserver: %w", lastErr)
		}
	}
	if lastErr != nil {
		return fmt.Errorf("apiserver: kube-apiserver: %w", lastErr)
	}
	// The self-signed serving certificate and the CA that signed it, as the API server
	// generated them (for 127.0.0.1 among others): Config trusts exactly these.
	ca, err := os.ReadFile(filepath.Join(certDir, "apiserver.crt"))
	if err != nil {
		return fmt.Errorf("apiserver: the serving certificate: %w", err)
	}
	s.Config = &rest.Config{
		Host:            s.URL,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: ca},
		UserAgent:       "curfew-apiserver-test",
		// A dry-run of many objects in a row: the default 5 QPS would only slow it down.
		QPS:     100,
		Burst:   200,
		Timeout: time.Minute,
	}
	return nil
}

// writeCredentials writes the token file (one token, of AdminUser in system:masters) and
// the service-account signing key pair, and returns the token.
func (s *Server) writeCredentials() (string, error) {
	raw := make([]byte, 32)
	if _, err := rand.Read(raw); err != nil {
		return "", fmt.Errorf("apiserver: token: %w", err)
	}
	token := hex.EncodeToString(raw)
	line := fmt.Sprintf("%s,%s,%s,\"system:masters\"\n", token, AdminUser, AdminUser)
	if err := os.WriteFile(filepath.Join(s.dir, "tokens.csv"), []byte(line), 0o600); err != nil {
		return "", fmt.Errorf("apiserver: %w", err)
	}
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return "", fmt.Errorf("apiserver: service-account key: %w", err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return "", fmt.Errorf("apiserver: service-account key: %w", err)
	}
	files := map[string]*pem.Block{
		"sa.key": {Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)},
		"sa.pub": {Type: "PUBLIC KEY", Bytes: pub},
	}
	for name, block := range files {
		if err := os.WriteFile(filepath.Join(s.dir, name), pem.EncodeToMemory(block), 0o600); err != nil {
			return "", fmt.Errorf("apiserver: %w", err)
		}
	}
	return token, nil
}
