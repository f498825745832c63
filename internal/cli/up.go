package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"   // SQLite paths
)

// prepareStore opens the store at dsn (creating and migrating it) and closes it.
func prepareStore(ctx context.Context, dsn string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := store.Open(ctx, dsn)
	if err != nil {
		return err
	}
	return st.Close()
}

// Endpoint is where one service listens.
type Endpoint struct {
	Addr      string `json:"addr"`
	AdminAddr string `json:"admin_addr"`
	PID       int    `json:"pid"`
}

// Endpoints is the content of DATA_DIR/endpoints.json, written by `curfew up`.
type Endpoints struct {
	Services  map[string]Endpoint `json:"services"`
	StartedAt time.Time           `json:"started_at"`
	// TLSDir is the directory of the mesh's mTLS files (DIR/tls, absolute) when the
	// services run mTLS, "" when they run plaintext (curfew up --insecure).
	TLSDir string `json:"tls_dir,omitempty"`
}

// EndpointsFile is the name of the endpoints file in the data directory.
const EndpointsFile = "endpoints.json"

func readEndpoints(dir string) (*Endpoints, error) {
	b, err := os.ReadFile(filepath.Join(dir, EndpointsFile)) //nolint:gosec // endpoints.json in the data directory the user names
	if err != nil {
		return nil, err
	}
	var e Endpoints
	if err := json.Unmarshal(b, &e); err != nil {
		return nil, fmt.Errorf("%s: %w", EndpointsFile, err)
	}
	return &e, nil
}

// services in start order; each gets two consecutive ports from the base.
var services = []string{"modelproxy", "subagent", "toolrunner", "orchestrator"}

var portOffset = map[string]int{"orchestrator": 0, "toolrunner": 2, "subagent": 4, "modelproxy": 6}

type child struct {
	name string
	ep   Endpoint
	cmd  *exec.Cmd
	done chan error
}

func cmdUp(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("up", stderr)
	dataDir := fs.String("data-dir", defaultDataDir(), "data directory: endpoints.json and logs/")
	basePort := fs.Int("base-port", 7700, "first of 8 consecutive ports (gRPC and admin per service); 0 picks free ports")
	binDir := fs.String("bin-dir", "", "directory of the service binaries (default: next to curfew, else $PATH)")
	grace := fs.Duration("shutdown-grace", service.DefaultShutdownGrace, "each service's --shutdown-grace: how long its in-flight calls and runs get to finish on stop; a service still running after its whole stop bound (docs/leases.md#drain) is killed")
	startTimeout := fs.Duration("start-timeout", 30*time.Second, "how long to wait for every service to report SERVING")
	asJSON := fs.Bool("json", false, "print the endpoints as JSON")
	providers := fs.String("providers-config", "", "modelproxy's providers file (docs/providers.md); default $CURFEW_PROVIDERS_CONFIG, else only the sim model")
	admissionFile := fs.String("admission-config", "", "orchestrator's admission file: pools, tenant limits, token budgets (docs/admission.md); default $CURFEW_ADMISSION_CONFIG, else the built-in pools")
	storeDSN := fs.String("store", "", "the durable store: a postgres:// DSN, or a SQLite path (default: curfew.db in --data-dir)")
	insecureFlag := fs.Bool("insecure", false, "run the services plaintext, without mTLS: only for local debugging (default: a local CA and per-service certificates in --data-dir/tls, re-issued at each start)")
	if _, err := parse(fs, args); err != nil {
		return usageErr(stderr, "up", err)
	}
	extra := map[string][]string{} // extra flags per service
	if *providers != "" {
		abs, err := filepath.Abs(*providers)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--providers-config: %w", err))
		}
		extra["modelproxy"] = append(extra["modelproxy"], "--providers-config", abs)
	}
	if *admissionFile != "" {
		abs, err := filepath.Abs(*admissionFile)
		if err == nil {
			_, err = os.Stat(abs)
		}
		if err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--admission-config: %w", err))
		}
		extra["orchestrator"] = append(extra["orchestrator"], "--admission-config", abs)
	}
	dsn := *storeDSN
	if dsn == "" {
		abs, err := filepath.Abs(filepath.Join(*dataDir, "curfew.db"))
		if err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--data-dir: %w", err))
		}
		dsn = "sqlite://" + abs
	}
	if *grace <= 0 {
		return usageErr(stderr, "up", fmt.Errorf("--shutdown-grace must be positive, got %v", *grace))
	}
	for _, svc := range services {
		extra[svc] = append(extra[svc], "--shutdown-grace", grace.String())
	}
	// A service stops within its drain delay (CURFEW_DRAIN_DELAY, which it inherits; 0 by
	// default) + --shutdown-grace + service.StopFlush; it is killed only a second after that.
	killAfter := *grace + service.StopFlush + time.Second
	if d, err := time.ParseDuration(os.Getenv(service.EnvName("drain-delay"))); err == nil && d > 0 {
		killAfter += d
	}
	for _, svc := range []string{"toolrunner", "orchestrator", "modelproxy"} { // the services that keep durable state
		extra[svc] = append(extra[svc], "--store", dsn)
	}
	if *basePort < 0 || *basePort > 65535-8 {
		return usageErr(stderr, "up", fmt.Errorf("--base-port must be 0 or between 1 and %d", 65535-8))
	}
	if err := os.MkdirAll(filepath.Join(*dataDir, "logs"), 0o755); err != nil { //nolint:gosec // the user's own logs, which hold no secrets
		return usageErr(stderr, "up", fmt.Errorf("--data-dir: %w", err))
	}
	tlsDir := ""
	if *insecureFlag {
		fmt.Fprintln(stderr, insecureWarning)
		for _, svc := range services {
			extra[svc] = append(extra[svc], "--insecure")
		}
	} else {
		var err error
		if tlsDir, err = prepareTLS(filepath.Join(*dataDir, TLSSubdir)); err != nil {
			return usageErr(stderr, "up", fmt.Errorf("--data-dir: mTLS certificates: %w", err))
		}
		for _, svc := range services {
			extra[svc] = append(extra[svc], "--tls-dir", tlsDir)
		}
	}
	// Open the store once before the services do: three processes creating and migrating
	// a new SQLite file at the same instant can fail to switch it to WAL (that needs the
	// file to themselves), and a bad DSN is better reported here than by three services.
	if err := prepareStore(ctx, dsn); err != nil {
		return usageErr(stderr, "up", fmt.Errorf("--store: %w", err))
	}
	if *insecureFlag { // no mTLS, so the CLI is no mesh peer: it needs an API key
		if err := prepareCLIKey(ctx, dsn, *dataDir); err != nil {
			return usageErr(stderr, "up", fmt.Errorf("the CLI's API key: %w", err))
		}
	}
	bins, err := findBinaries(*binDir)
	if err != nil {
		return usageErr(stderr, "up", err)
	}
	eps, err := allocate(*basePort)
	if err != nil {
		fmt.Fprintln(stderr, "curfew up:", err)
		return ExitFail
	}

	ctx, stop := signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
	defer stop()

	var children []*child
	shutdown := func() {
		// The orchestrator first, so that its runs end or are handed over while the rest
		// still serve.
		for i := len(children) - 1; i >= 0; i-- {
			stopChild(children[i], killAfter)
		}
	}
	for _, name := range services {
		c, err := startChild(name, bins[name], eps, *dataDir, extra[name])
		if err != nil {
			fmt.Fprintln(stderr, "curfew up:", err)
			shutdown()
			return ExitFail
		}
		children = append(children, c)
	}
	if err := waitServing(ctx, children, *startTimeout, tlsDir); err != nil {
		fmt.Fprintln(stderr, "curfew up:", err, "(see", filepath.Join(*dataDir, "logs")+")")
		shutdown()
		return ExitFail
	}
	out := Endpoints{Services: map[string]Endpoint{}, StartedAt: time.Now().UTC(), TLSDir: tlsDir}
	for _, c := range children {
		out.Services[c.name] = c.ep
	}
	b, _ := json.MarshalIndent(out, "", "  ")
	if err := os.WriteFile(filepath.Join(*dataDir, EndpointsFile), append(b, '\n'), 0o644); err != nil { //nolint:gosec // addresses only, read by every client command
		fmt.Fprintln(stderr, "curfew up:", err)
		shutdown()
		return ExitFail
	}
	if *asJSON {
		c, _ := json.Marshal(out)
		fmt.Fprintln(stdout, string(c))
		fmt.Fprintln(stdout, `{"ready":true}`)
	} else {
		for i := len(children) - 1; i >= 0; i-- {
			c := children[i]
			fmt.Fprintf(stdout, "%-13s %-21s admin http://%s  pid %d\n", c.name, c.ep.Addr, c.ep.AdminAddr, c.ep.PID)
		}
		fmt.Fprintf(stdout, "endpoints     %s\nlogs          %s\n", filepath.Join(*dataDir, EndpointsFile), filepath.Join(*dataDir, "logs"))
		if tlsDir != "" {
			fmt.Fprintf(stdout, "mtls          %s\n", tlsDir)
		} else {
			fmt.Fprintln(stdout, "mtls          off (--insecure)")
		}
		fmt.Fprintln(stdout, "ready")
	}

	exit := ExitOK
	died := make(chan *child, len(children))
	for _, c := range children {
		go func() { err := <-c.done; c.done <- err; died <- c }()
	}
	select {
	case <-ctx.Done():
	case c := <-died:
		err := <-c.done
		c.done <- err
		fmt.Fprintf(stderr, "curfew up: %s exited unexpectedly: %v; stopping the mesh\n", c.name, err)
		exit = ExitFail
	}
	shutdown()
	_ = os.Remove(filepath.Join(*dataDir, EndpointsFile))
	if exit == ExitOK && !*asJSON {
		fmt.Fprintln(stdout, "stopped")
	}
	return exit
}

func findBinaries(dir string) (map[string]string, error) {
	if dir == "" {
		if exe, err := os.Executable(); err == nil {
			dir = filepath.Dir(exe)
		}
	}
	out := map[string]string{}
	for _, name := range services {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() {
			out[name] = p
			continue
		}
		lp, err := exec.LookPath(name)
		if err != nil {
			return nil, fmt.Errorf("service binary %q not found in %s nor on $PATH (build them with `make build`, or pass --bin-dir)", name, dir)
		}
		out[name] = lp
	}
	return out, nil
}

// allocate assigns listen addresses: base, base+1, ... or free ports when base is 0.
func allocate(base int) (map[string]Endpoint, error) {
	eps := map[string]Endpoint{}
	for _, name := range services {
		var ports [2]int
		for i := range ports {
			if base != 0 {
				ports[i] = base + portOffset[name] + i
				continue
			}
			l, err := net.Listen("tcp", "127.0.0.1:0") //nolint:noctx // a local bind, nothing to cancel
			if err != nil {
				return nil, fmt.Errorf("pick a free port: %w", err)
			}
			ports[i] = l.Addr().(*net.TCPAddr).Port
			defer l.Close() // hold every port until all are picked, so none repeats
		}
		eps[name] = Endpoint{Addr: "127.0.0.1:" + strconv.Itoa(ports[0]), AdminAddr: "127.0.0.1:" + strconv.Itoa(ports[1])}
	}
	return eps, nil
}

// startChild starts one service with its addresses and extra flags.
func startChild(name, bin string, eps map[string]Endpoint, dataDir string, extra []string) (*child, error) {
	ep := eps[name]
	args := []string{"--addr", ep.Addr, "--admin-addr", ep.AdminAddr}
	switch name {
	case "orchestrator":
		args = append(args, "--modelproxy", eps["modelproxy"].Addr, "--toolrunner", eps["toolrunner"].Addr, "--subagent", eps["subagent"].Addr)
	case "toolrunner":
		args = append(args, "--subagent", eps["subagent"].Addr)
	case "subagent":
		args = append(args, "--modelproxy", eps["modelproxy"].Addr, "--toolrunner", eps["toolrunner"].Addr)
	}
	args = append(args, extra...)
	logf, err := os.OpenFile(filepath.Join(dataDir, "logs", name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644) //nolint:gosec // the user's own logs, which hold no secrets
	if err != nil {
		return nil, err
	}
	// Not CommandContext: a context kill would SIGKILL the service; stopChild stops it in
	// order with SIGTERM and a grace instead.
	cmd := exec.Command(bin, args...) //nolint:noctx,gosec // see above; bin is a service binary from --bin-dir or next to curfew
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own process group: a terminal's Ctrl-C reaches only curfew up, which stops the
	// services in order. Pdeathsig stops them if curfew up itself is killed.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	ep.PID = cmd.Process.Pid
	c := &child{name: name, ep: ep, cmd: cmd, done: make(chan error, 1)}
	go func() { err := cmd.Wait(); _ = logf.Close(); c.done <- err }()
	return c, nil
}

func stopChild(c *child, grace time.Duration) {
	select {
	case err := <-c.done:
		c.done <- err
		return
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case err := <-c.done:
		c.done <- err
	case <-t.C:
		_ = c.cmd.Process.Kill()
		err := <-c.done
		c.done <- err
	}
}

// waitServing waits until every child's gRPC health is SERVING, asking as curfew-cli
// with the mTLS files in tlsDir ("" for plaintext).
func waitServing(ctx context.Context, children []*child, timeout time.Duration, tlsDir string) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for _, c := range children {
		creds, err := clientCredentials(tlsDir, c.name)
		if err != nil {
			return err
		}
		conn, err := grpc.NewClient(c.ep.Addr, grpc.WithTransportCredentials(creds))
		if err != nil {
			return err
		}
		hc := healthpb.NewHealthClient(conn)
		for {
			select {
			case err := <-c.done:
				c.done <- err
				_ = conn.Close()
				return fmt.Errorf("%s exited during start-up: %w", c.name, err)
			default:
			}
			cctx, ccancel := context.WithTimeout(ctx, time.Second)
			resp, err := hc.Check(cctx, &healthpb.HealthCheckRequest{})
			ccancel()
			if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
				break
			}
			if ctx.Err() != nil {
				_ = conn.Close()
				return errors.Join(fmt.Errorf("%s did not report SERVING within %v", c.name, timeout), err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		_ = conn.Close()
	}
	return nil
}
