package meshproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/curfew-mesh/curfew/internal/launch"
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

// Proc is one service process of a Cluster (a launch.Process: Kill, Stop, Running).
// Its addresses stay the same across restarts, as a Kubernetes Service's would.
type Proc struct {
	*launch.Process
	started bool // Start has succeeded once: its addresses are now its own
	peered  bool // another process was given Addr, which therefore cannot change
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

// freeAddrs returns n distinct 127.0.0.1 addresses nothing listens on at the moment.
// Each is released before the service binds it, so another socket may take it
// meanwhile: Start then picks again.
func freeAddrs(ctx context.Context, n int) ([]string, error) {
	var lc net.ListenConfig
	addrs := make([]string, n)
	for i := range addrs {
		l, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer l.Close() // held until all are picked, so none repeats
		addrs[i] = l.Addr().String()
	}
	return addrs, nil
}

// Add declares a process: service is the binary ("orchestrator", ...), name its unique
// name in the cluster (for example "orchestrator-a"); args come after its addresses.
func (c *Cluster) Add(ctx context.Context, service, name string, args ...string) (*Proc, error) {
	addrs, err := freeAddrs(ctx, 1)
	if err != nil {
		return nil, err
	}
	return c.AddAt(ctx, service, name, addrs[0], args...)
}

// AddAt is Add with the gRPC address given: replicas of one service on the same port
// and different loopback IPs (127.0.0.1:P, 127.0.0.2:P), as pods behind one name.
func (c *Cluster) AddAt(ctx context.Context, service, name, addr string, args ...string) (*Proc, error) {
	admin, err := freeAddrs(ctx, 1)
	if err != nil {
		return nil, err
	}
	p := &Proc{Process: &launch.Process{Name: name, Addr: addr, AdminAddr: admin[0], Bin: filepath.Join(c.bin, service),
		// Plaintext: the processes' TLS is not what these tests are about.
		Args: append([]string{"--addr", addr, "--admin-addr", admin[0], "--log-level", "debug", "--insecure"}, args...),
		Log:  filepath.Join(c.Dir, name+".log"),
		// A test binary that dies takes its processes with it at once.
		ParentDeathSignal: syscall.SIGKILL}}
	c.mu.Lock()
	c.procs[name] = p
	c.mu.Unlock()
	return p, nil
}

// Start starts the process and waits until its gRPC health is SERVING. A first start
// that finds one of its free ports taken meanwhile (by another process's outgoing
// connection, say) picks that port again, unless a peer already knows it.
func (p *Proc) Start(ctx context.Context) error {
	for attempt := 1; ; attempt++ {
		err := p.start(ctx)
		if err == nil || p.started || attempt == 3 || !p.repick(ctx) {
			return err
		}
	}
}

func (p *Proc) start(ctx context.Context) error {
	if err := p.Process.Start(); err != nil {
		return err
	}
	if err := launch.WaitServing(ctx, 30*time.Second, p.Process); err != nil {
		return fmt.Errorf("%w; its log ends:\n%s\n(all of it in %s)", err, logTail(p.Log, 10), p.Log)
	}
	p.started = true
	return nil
}

// repick gives the process new addresses for those its log says were in use, and
// reports whether it did.
func (p *Proc) repick(ctx context.Context) bool {
	log, err := os.ReadFile(p.Log) //nolint:gosec // the log file this package created
	if err != nil || !bytes.Contains(log, []byte("address already in use")) {
		return false
	}
	changed := false
	for i, a := range p.Args {
		if i == 0 || (p.Args[i-1] != "--addr" && p.Args[i-1] != "--admin-addr") || !bytes.Contains(log, []byte(a+": bind: address already in use")) {
			continue
		}
		if a == p.Addr && p.peered {
			return false
		}
		fresh, err := freeAddrs(ctx, 1)
		if err != nil {
			return false
		}
		if a == p.Addr {
			p.Addr = fresh[0]
		} else {
			p.AdminAddr = fresh[0]
		}
		p.Args[i], changed = fresh[0], true
	}
	return changed
}

// logTail returns the last n lines of the log at path.
func logTail(path string, n int) string {
	data, err := os.ReadFile(path) //nolint:gosec // the log file this package created
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
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
	tools, err = c.Add(ctx, "toolrunner", "toolrunner", append(append([]string{"--store", c.Store}, launch.PeerFlags("toolrunner", endpoints(map[string]*Proc{"subagent": sub}))...), extra["toolrunner"]...)...)
	if err != nil {
		return nil, nil, nil, err
	}
	sub.Args = append(sub.Args, append(launch.PeerFlags("subagent", endpoints(map[string]*Proc{"modelproxy": model, "toolrunner": tools})), extra["subagent"]...)...)
	for _, p := range []*Proc{model, tools, sub} {
		if err := p.Start(ctx); err != nil {
			return nil, nil, nil, err
		}
	}
	return model, sub, tools, nil
}

// OrchestratorArgs are the flags of an orchestrator on the cluster's executors and store.
func (c *Cluster) OrchestratorArgs(model, sub, tools *Proc, extra ...string) []string {
	return append(append([]string{"--store", c.Store}, launch.PeerFlags("orchestrator", endpoints(map[string]*Proc{"modelproxy": model, "subagent": sub, "toolrunner": tools}))...), extra...)
}

// endpoints are the endpoints of processes by service name.
func endpoints(procs map[string]*Proc) map[string]launch.Endpoint {
	eps := map[string]launch.Endpoint{}
	for svc, p := range procs {
		p.peered = true
		eps[svc] = launch.Endpoint{Addr: p.Addr, AdminAddr: p.AdminAddr}
	}
	return eps
}
