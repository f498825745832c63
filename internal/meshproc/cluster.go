package meshproc

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"   // SQLite paths
)

// Cluster is a mesh whose service processes a test starts, kills and restarts one by
// one (`curfew up` stops the whole mesh when one of them dies): a modelproxy, a
// subagent, a toolrunner and any number of orchestrators, all on one durable store. Its
// processes run plaintext (--insecure); Mesh runs mTLS.
type Cluster struct {
	Dir   string // logs go to Dir/<name>.log
	Store string // the store DSN every service gets
	// APIKey is an API key of tenant md.DefaultTenant in Store: over plaintext no caller
	// is a mesh peer, so the orchestrators take only callers with a key. Conn sends it;
	// give it to the curfew command as $CURFEW_API_KEY.
	APIKey string
	bin    string

	mu    sync.Mutex
	procs map[string]*Proc
	conns []*grpc.ClientConn
}

// Proc is one service process of a Cluster. Its addresses stay the same across
// restarts, as a Kubernetes Service's would.
type Proc struct {
	Name      string
	Addr      string
	AdminAddr string
	bin       string
	args      []string
	log       string

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{} // closed when cmd has exited; exitErr is then set
	exitErr error
}

// NewCluster builds the binaries if needed and returns an empty cluster on store, which
// it opens (creating and migrating it) to make the cluster's API key.
func NewCluster(ctx context.Context, dir, storeDSN string) (*Cluster, error) {
	bin, err := Build()
	if err != nil {
		return nil, err
	}
	st, err := store.Open(ctx, storeDSN)
	if err != nil {
		return nil, err
	}
	defer func() { _ = st.Close() }()
	k, err := apikey.New(md.DefaultTenant)
	if err != nil {
		return nil, err
	}
	if _, _, err := st.CreateAPIKey(ctx, k.Record, false); err != nil {
		return nil, err
	}
	return &Cluster{Dir: dir, Store: storeDSN, APIKey: k.Secret, bin: bin, procs: map[string]*Proc{}}, nil
}

// freeAddr returns a 127.0.0.1 address nothing listens on at the moment.
func freeAddr(ctx context.Context) (string, error) {
	var lc net.ListenConfig
	l, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// Add declares a process: service is the binary ("orchestrator", ...), name its unique
// name in the cluster (for example "orchestrator-a"); args come after its addresses.
func (c *Cluster) Add(ctx context.Context, service, name string, args ...string) (*Proc, error) {
	addr, err := freeAddr(ctx)
	if err != nil {
		return nil, err
	}
	return c.AddAt(ctx, service, name, addr, args...)
}

// AddAt is Add with the gRPC address given: replicas of one service on the same port
// and different loopback IPs (127.0.0.1:P, 127.0.0.2:P), as pods behind one name.
func (c *Cluster) AddAt(ctx context.Context, service, name, addr string, args ...string) (*Proc, error) {
	admin, err := freeAddr(ctx)
	if err != nil {
		return nil, err
	}
	p := &Proc{Name: name, Addr: addr, AdminAddr: admin, bin: filepath.Join(c.bin, service),
		// Plaintext: the processes' TLS is not what these tests are about.
		args: append([]string{"--addr", addr, "--admin-addr", admin, "--log-level", "debug", "--insecure"}, args...),
		log:  filepath.Join(c.Dir, name+".log")}
	c.mu.Lock()
	c.procs[name] = p
	c.mu.Unlock()
	return p, nil
}

// Start starts the process and waits until its gRPC health is SERVING.
func (p *Proc) Start(ctx context.Context) error {
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644) //nolint:gosec // a test mesh's logs
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...) //nolint:noctx,gosec // killed by Kill or Stop, not by a context; a binary this package built
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return fmt.Errorf("start %s: %w", p.Name, err)
	}
	done := make(chan struct{})
	go func() {
		err := cmd.Wait()
		_ = logf.Close()
		p.mu.Lock()
		p.exitErr = err
		p.mu.Unlock()
		close(done)
	}()
	p.mu.Lock()
	p.cmd, p.done = cmd, done
	p.mu.Unlock()
	return p.waitServing(ctx, done)
}

func (p *Proc) waitServing(ctx context.Context, done chan struct{}) error {
	conn, err := grpc.NewClient(p.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		cctx, stop := context.WithTimeout(ctx, time.Second)
		resp, err := hc.Check(cctx, &healthpb.HealthCheckRequest{})
		stop()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		select {
		case <-done:
			p.mu.Lock()
			err := p.exitErr
			p.cmd = nil
			p.mu.Unlock()
			return fmt.Errorf("%s exited during start-up (see %s): %w", p.Name, p.log, err)
		case <-ctx.Done():
			return fmt.Errorf("%s not serving: %w; see %s", p.Name, ctx.Err(), p.log)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Kill ends the process with SIGKILL, as a crash or an OOM kill would, and waits.
func (p *Proc) Kill() error { return p.signal(syscall.SIGKILL, 10*time.Second) }

// Stop ends the process with SIGTERM (graceful shutdown) and waits up to wait.
func (p *Proc) Stop(wait time.Duration) error { return p.signal(syscall.SIGTERM, wait) }

func (p *Proc) signal(sig syscall.Signal, wait time.Duration) error {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.cmd = nil
	p.mu.Unlock()
	if cmd == nil {
		return nil
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done: // a killed process's exit status says nothing more
		return nil
	case <-time.After(wait):
		_ = cmd.Process.Kill()
		<-done
		return fmt.Errorf("%s did not exit within %v of %v", p.Name, wait, sig)
	}
}

// Running reports whether the process is up.
func (p *Proc) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil
}

// Conn returns a client connection to proc that sends the cluster's APIKey, closed by
// Close.
func (c *Cluster) Conn(p *Proc) (*grpc.ClientConn, error) {
	conn, err := grpc.NewClient(p.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(apikey.Bearer(c.APIKey)))
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.conns = append(c.conns, conn)
	c.mu.Unlock()
	return conn, nil
}

// Bin returns the path of a binary ("curfew", "orchestrator", ...).
func (c *Cluster) Bin(name string) string { return filepath.Join(c.bin, name) }

// Close closes the connections and stops every process still running (SIGTERM, then
// SIGKILL after 10 s).
func (c *Cluster) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, conn := range c.conns {
		_ = conn.Close()
	}
	var errs []error
	for _, p := range c.procs {
		if err := p.Stop(10 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Mesh declares and starts the three executors on the cluster's store: modelproxy,
// subagent and toolrunner (in dependency order), with extra args per service name.
// Orchestrators are added by the caller with OrchestratorArgs.
func (c *Cluster) Mesh(ctx context.Context, extra map[string][]string) (model, sub, tools *Proc, err error) {
	model, err = c.Add(ctx, "modelproxy", "modelproxy", append([]string{"--store", c.Store}, extra["modelproxy"]...)...)
	if err != nil {
		return nil, nil, nil, err
	}
	// subagent and toolrunner call each other: both addresses are fixed before either starts.
	sub, err = c.Add(ctx, "subagent", "subagent")
	if err != nil {
		return nil, nil, nil, err
	}
	tools, err = c.Add(ctx, "toolrunner", "toolrunner", append([]string{"--store", c.Store, "--subagent", sub.Addr}, extra["toolrunner"]...)...)
	if err != nil {
		return nil, nil, nil, err
	}
	sub.args = append(sub.args, append([]string{"--modelproxy", model.Addr, "--toolrunner", tools.Addr}, extra["subagent"]...)...)
	for _, p := range []*Proc{model, tools, sub} {
		if err := p.Start(ctx); err != nil {
			return nil, nil, nil, err
		}
	}
	return model, sub, tools, nil
}

// OrchestratorArgs are the flags of an orchestrator on the cluster's executors and store.
func (c *Cluster) OrchestratorArgs(model, sub, tools *Proc, extra ...string) []string {
	return append([]string{"--store", c.Store, "--modelproxy", model.Addr, "--subagent", sub.Addr, "--toolrunner", tools.Addr}, extra...)
}
