package soak

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	toxiproxy "github.com/Shopify/toxiproxy/v2/client"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/dnsstub"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/apikey"
)

// ReplicaIPs are the loopback addresses of a service's replicas in a Cluster: replica
// "a" on the first, "b" on the second, as two pods behind one name.
var ReplicaIPs = []string{"127.0.0.1", "127.0.0.2"}

// Services are the service kinds of a Cluster, in start order (each one's peers first).
var Services = []string{"modelproxy", "subagent", "toolrunner", "orchestrator"}

// Cluster is the soak's mesh of two replicas of every service, not `curfew up` (which
// runs one of each). Every replica listens on its own loopback address behind a
// toxiproxy proxy on that address, and a service's callers reach its replicas through
// one DNS name that resolves to both (dnsstub; round robin, as in Kubernetes), so that
// latency, resets and timeouts can be put on any hop of any replica. The services share
// one PostgreSQL store; they run plaintext (--insecure) with the cluster's API key, as
// meshproc.Cluster does. The MCP test server runs once, over streamable HTTP, shared by
// both toolrunners as a remote MCP server would be.
type Cluster struct {
	// Record is the MCP test server's record of calls (EffectsFromRecord).
	Record string
	// Replicas are each service's replicas, a then b.
	Replicas map[string][]*meshproc.Proc

	mesh    *meshproc.Cluster
	dns     *dnsstub.Server
	toxi    *toxiproxy.Client
	proxies map[string][]*toxiproxy.Proxy // in front of Replicas, by service
	fronts  []string                      // the orchestrators' proxied addresses
	helpers []*exec.Cmd                   // toxiproxy-server and the MCP server
	conns   []*grpc.ClientConn
}

// StartCluster builds the binaries (meshproc.Build) and starts a Cluster in dir (emptied
// first) on the PostgreSQL store at storeDSN, sized for concurrency runs in flight as
// StartMesh is. toxiproxy-server comes from the repository's .tools/bin
// (scripts/tools.sh) or $PATH. Close stops it all.
func StartCluster(ctx context.Context, dir string, concurrency int, storeDSN string) (_ *Cluster, err error) {
	dir, err = filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	_ = os.RemoveAll(dir)
	if err := os.MkdirAll(dir, 0o755); err != nil { //nolint:gosec // the mesh's data directory
		return nil, err
	}
	mc, err := meshproc.NewCluster(ctx, dir, storeDSN)
	if err != nil {
		return nil, err
	}
	c := &Cluster{Replicas: map[string][]*meshproc.Proc{}, proxies: map[string][]*toxiproxy.Proxy{}, mesh: mc,
		Record: filepath.Join(dir, "mcp-calls.jsonl")}
	defer func() {
		if err != nil {
			_ = c.Close()
		}
	}()
	if err := c.startToxiproxy(ctx, dir); err != nil {
		return nil, err
	}
	mcpURL, err := c.startMCP(ctx, dir)
	if err != nil {
		return nil, err
	}

	// Every service's public port (its proxies', on both addresses) and backend port
	// (its processes').
	public, backend := map[string]int{}, map[string]int{}
	records := map[string][]string{}
	for _, svc := range Services {
		if public[svc], err = freePort(ctx); err != nil {
			return nil, err
		}
		if backend[svc], err = freePort(ctx); err != nil {
			return nil, err
		}
		records[name(svc)] = ReplicaIPs
	}
	if c.dns, err = dnsstub.Start(ctx, records); err != nil {
		return nil, err
	}
	target := func(svc string) string { return c.dns.Target(name(svc), public[svc]) }

	tools := filepath.Join(dir, "tools.json")
	if err := os.WriteFile(tools, fmt.Appendf(nil, `{"sources": [{"name": "fx", "kind": "mcp_http", "url": %q, "side_effects": "irreversible"}]}`, mcpURL), 0o600); err != nil {
		return nil, err
	}
	admission := filepath.Join(dir, "admission.json")
	if err := os.WriteFile(admission, fmt.Appendf(nil, `{"pools": [{"name": "soak", "max_in_flight": %d, "max_queue": %d, "max_queue_age": "30s"}]}`,
		concurrency+concurrency/2, max(concurrency, 16)), 0o600); err != nil {
		return nil, err
	}
	common := []string{"--pprof", "--retention", "5s"}
	args := map[string][]string{
		"modelproxy": {"--store", storeDSN},
		"subagent":   {"--modelproxy", target("modelproxy"), "--toolrunner", target("toolrunner")},
		"toolrunner": {"--store", storeDSN, "--subagent", target("subagent"), "--tools-config", tools},
		"orchestrator": {"--store", storeDSN, "--modelproxy", target("modelproxy"), "--toolrunner", target("toolrunner"),
			"--subagent", target("subagent"), "--admission-config", admission, "--cluster-replicas", strconv.Itoa(len(ReplicaIPs)),
			"--max-runs", strconv.Itoa(4 * max(concurrency, 16))},
	}
	for _, svc := range Services {
		for i, ip := range ReplicaIPs {
			front := net.JoinHostPort(ip, strconv.Itoa(public[svc]))
			a := append(append([]string{}, common...), args[svc]...)
			if svc == "orchestrator" {
				// Leases name the proxied address: a CancelRun or WatchRun forwarded to a
				// run's owner crosses its proxy too.
				a = append(a, "--advertise-addr", front)
				c.fronts = append(c.fronts, front)
			}
			replica := svc + "-" + string(rune('a'+i))
			p, err := mc.AddAt(ctx, svc, replica, net.JoinHostPort(ip, strconv.Itoa(backend[svc])), a...)
			if err != nil {
				return nil, err
			}
			px, err := c.toxi.CreateProxy(replica, front, p.Addr)
			if err != nil {
				return nil, fmt.Errorf("toxiproxy: proxy for %s: %w", replica, err)
			}
			c.Replicas[svc] = append(c.Replicas[svc], p)
			c.proxies[svc] = append(c.proxies[svc], px)
		}
	}
	// subagent and toolrunner call each other by name: both know the other's target
	// before either starts, and each dials lazily.
	for _, svc := range Services {
		for _, p := range c.Replicas[svc] {
			if err := p.Start(ctx); err != nil {
				return nil, err
			}
		}
	}
	return c, nil
}

// name is a service's DNS name.
func name(svc string) string { return svc + ".curfew.test" }

// freePort returns a TCP port free on every address of ReplicaIPs at the moment.
func freePort(ctx context.Context) (int, error) {
	var lc net.ListenConfig
	for range 20 {
		l, err := lc.Listen(ctx, "tcp", net.JoinHostPort(ReplicaIPs[0], "0"))
		if err != nil {
			return 0, err
		}
		port := l.Addr().(*net.TCPAddr).Port
		free := true
		for _, ip := range ReplicaIPs[1:] {
			o, err := lc.Listen(ctx, "tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
			if err != nil {
				free = false
				break
			}
			_ = o.Close()
		}
		_ = l.Close()
		if free {
			return port, nil
		}
	}
	return 0, errors.New("no port free on every replica address")
}

// startToxiproxy starts toxiproxy-server on a free port of 127.0.0.1 and waits for its API.
func (c *Cluster) startToxiproxy(ctx context.Context, dir string) error {
	bin, err := toxiproxyBin()
	if err != nil {
		return err
	}
	port, err := freePort(ctx)
	if err != nil {
		return err
	}
	api := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	cmd, err := c.helper(dir, "toxiproxy", bin, "-host", "127.0.0.1", "-port", strconv.Itoa(port))
	if err != nil {
		return err
	}
	cmd.Env = append(os.Environ(), "LOG_LEVEL=warn") // not a line per connection
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("toxiproxy-server: %w", err)
	}
	c.toxi = toxiproxy.NewClient(api)
	return waitUntil(ctx, 10*time.Second, "toxiproxy-server's API on "+api, func() bool {
		_, err := c.toxi.Version()
		return err == nil
	})
}

// toxiproxyBin finds toxiproxy-server: the repository's .tools/bin, else $PATH.
func toxiproxyBin() (string, error) {
	if repo, err := meshproc.Repo(); err == nil {
		if p := filepath.Join(repo, ".tools", "bin", "toxiproxy-server"); fileExists(p) {
			return p, nil
		}
	}
	p, err := exec.LookPath("toxiproxy-server")
	if err != nil {
		return "", errors.New("toxiproxy-server not found in .tools/bin or $PATH: run scripts/tools.sh")
	}
	return p, nil
}

func fileExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir()
}

// startMCP builds and starts the MCP test server over streamable HTTP, recording its calls
// to c.Record, and returns its URL.
func (c *Cluster) startMCP(ctx context.Context, dir string) (string, error) {
	bin, err := buildMCPTest(ctx, dir)
	if err != nil {
		return "", err
	}
	port, err := freePort(ctx)
	if err != nil {
		return "", err
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	cmd, err := c.helper(dir, "mcptest", bin, "--http", addr, "--record", c.Record)
	if err != nil {
		return "", err
	}
	if err := cmd.Start(); err != nil {
		return "", fmt.Errorf("curfew-mcptest: %w", err)
	}
	url := "http://" + addr + "/"
	return url, waitUntil(ctx, 10*time.Second, "the MCP test server on "+addr, func() bool {
		conn, err := new(net.Dialer).DialContext(ctx, "tcp", addr)
		if err == nil {
			_ = conn.Close()
		}
		return err == nil
	})
}

// helper is a command of the cluster's own (not a service) logging to dir/logs/<name>.log,
// killed with its parent, stopped by Close.
func (c *Cluster) helper(dir, name, bin string, args ...string) (*exec.Cmd, error) {
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil { //nolint:gosec // logs for people to read
		return nil, err
	}
	logf, err := os.Create(filepath.Join(dir, "logs", name+".log")) //nolint:gosec // the mesh's log directory
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...) //nolint:noctx,gosec // stopped by Close (SIGTERM), not by a context's SIGKILL
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	c.helpers = append(c.helpers, cmd)
	return cmd, nil
}

// waitUntil polls ok every 50 ms until it holds, or fails after timeout.
func waitUntil(ctx context.Context, timeout time.Duration, what string, ok func() bool) error {
	end := time.Now().Add(timeout)
	for !ok() {
		if time.Now().After(end) {
			return fmt.Errorf("%s: not up within %v", what, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

// Orchestrators are clients of each orchestrator replica through its proxy (the load's
// front door crosses toxiproxy too), with the cluster's API key.
func (c *Cluster) Orchestrators() ([]orchestratorv1.OrchestratorServiceClient, error) {
	var out []orchestratorv1.OrchestratorServiceClient
	for _, front := range c.fronts {
		conn, err := grpc.NewClient(front, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithPerRPCCredentials(apikey.Bearer(c.mesh.APIKey)))
		if err != nil {
			return nil, err
		}
		c.conns = append(c.conns, conn)
		out = append(out, orchestratorv1.NewOrchestratorServiceClient(conn))
	}
	return out, nil
}

// Processes are the cluster's service processes, to sample: modelproxy-a, modelproxy-b, ...
func (c *Cluster) Processes() []Process {
	var ps []Process
	for _, svc := range Services {
		for _, p := range c.Replicas[svc] {
			ps = append(ps, Process{Name: p.Name, Admin: p.AdminAddr})
		}
	}
	return ps
}

// Serving checks that every replica answers /readyz after a load, the killed ones
// restarted included.
func (c *Cluster) Serving(ctx context.Context) []Check {
	hc := &http.Client{Timeout: 2 * time.Second}
	var out []Check
	for _, p := range c.Processes() {
		ok := false
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.Admin+"/readyz", nil)
		if err == nil {
			if resp, err := hc.Do(req); err == nil {
				ok = resp.StatusCode == http.StatusOK
				_ = resp.Body.Close()
			}
		}
		out = append(out, Check{Name: "serving after the load: " + p.Name, OK: ok, Detail: "/readyz on " + p.Admin})
	}
	return out
}

// ModelproxyNotFenced checks that no orchestrator's breaker for modelproxy opened during
// the load (curfew_circuit_breaker_transitions_total{target="modelproxy",to="open"}, per
// orchestrator process running at the end). The faults take down one modelproxy replica
// at a time (a kill, latency), never both: the other serves throughout, so one
// replica's failures must not fence off the service (docs/breakers.md, "One replica down
// is not the service down").
func (c *Cluster) ModelproxyNotFenced(ctx context.Context) []Check {
	hc := &http.Client{Timeout: 2 * time.Second}
	var out []Check
	for _, p := range c.Processes() {
		if !strings.HasPrefix(p.Name, "orchestrator") {
			continue
		}
		name := "modelproxy's breaker never opened: " + p.Name
		mfs, err := scrape(ctx, hc, "http://"+p.Admin+"/metrics")
		if err != nil {
			out = append(out, Check{Name: name, Detail: err.Error()})
			continue
		}
		var opened float64
		for _, m := range mfs["curfew_circuit_breaker_transitions_total"].GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["target"] == "modelproxy" && labels["to"] == "open" {
				opened += m.GetCounter().GetValue()
			}
		}
		out = append(out, Check{Name: name, OK: opened == 0, Detail: fmt.Sprintf("opened %.0f times", opened)})
	}
	return out
}

// Close stops the services, the MCP server and toxiproxy, and closes the connections.
func (c *Cluster) Close() error {
	for _, conn := range c.conns {
		_ = conn.Close()
	}
	err := c.mesh.Close()
	for _, h := range c.helpers {
		if h.Process != nil {
			_ = h.Process.Signal(syscall.SIGTERM)
			_, _ = h.Process.Wait()
		}
	}
	if c.dns != nil {
		_ = c.dns.Close()
	}
	return err
}
