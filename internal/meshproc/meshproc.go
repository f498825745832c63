package meshproc

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/launch"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// Repo returns the repository root (the directory holding go.work).
func Repo() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("meshproc: cannot locate the source tree")
	}
	dir := filepath.Dir(file)
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.work")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("meshproc: go.work not found above " + file)
		}
		dir = parent
	}
}

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// Build compiles the CLI and the services into a temporary directory, once per process,
// and returns it. Set CURFEW_BIN_DIR to reuse binaries built elsewhere (for example by
// `make build`).
func Build() (string, error) {
	buildOnce.Do(func() {
		if d := os.Getenv("CURFEW_BIN_DIR"); d != "" {
			binDir = d
			return
		}
		repo, err := Repo()
		if err != nil {
			buildErr = err
			return
		}
		binDir, buildErr = os.MkdirTemp("", "curfew-bin-")
		if buildErr != nil {
			return
		}
		targets := map[string]string{"curfew": "./cmd/curfew"}
		for _, s := range []string{"orchestrator", "toolrunner", "subagent", "modelproxy"} {
			targets[s] = "./services/" + s + "/cmd/" + s
		}
		for name, pkg := range targets {
			dir := repo
			if strings.HasPrefix(pkg, "./services/") {
				parts := strings.SplitN(strings.TrimPrefix(pkg, "./services/"), "/", 2)
				dir = filepath.Join(repo, "services", parts[0])
				pkg = "./" + parts[1]
			}
			args := []string{"build", "-o", filepath.Join(binDir, name)}
			if os.Getenv("CURFEW_RACE") == "1" {
				args = append(args, "-race")
			}
			cmd := exec.Command("go", append(args, pkg)...) //nolint:noctx,gosec // a bounded build, once per process, of this repository's packages
			cmd.Dir = dir
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("go build %s: %w\n%s", name, err, out)
				return
			}
		}
	})
	return binDir, buildErr
}

// Cleanup removes the binaries Build made (not a CURFEW_BIN_DIR given from outside). Call
// it once the process's meshes have stopped, for example at the end of TestMain.
func Cleanup() {
	if os.Getenv("CURFEW_BIN_DIR") != "" || binDir == "" {
		return
	}
	_ = os.RemoveAll(binDir)
}

// Mesh is a running mesh: four service processes under one `curfew up`.
type Mesh struct {
	Dir       string // data directory
	Bin       string // directory of the binaries
	Endpoints struct {
		Services map[string]launch.Endpoint `json:"services"`
		// TLSDir holds the mesh's mTLS files; "" when it runs plaintext (Options.Insecure).
		TLSDir string `json:"tls_dir"`
	}
	up    *exec.Cmd
	mu    sync.Mutex // guards conns: parallel tests open connections
	conns []*grpc.ClientConn
	done  chan error
}

// Options tune Start.
type Options struct {
	// Env is added to the environment of `curfew up` and so of every service
	// (for example CURFEW_MAX_DEADLINE=1m).
	Env []string
	// Insecure starts `curfew up --insecure`: plaintext, no mTLS.
	Insecure bool
	// Args are added to `curfew up`'s flags (for example --tools-config FILE).
	Args []string
	// Dir is the working directory of `curfew up` and so of every service; "" is the
	// test's.
	Dir string
	// Stderr receives `curfew up`'s standard error; os.Stderr when nil.
	Stderr io.Writer
}

// Start builds the binaries if needed and starts `curfew up --base-port 0` in dataDir,
// returning once it printed ready.
func Start(ctx context.Context, dataDir string, o Options) (*Mesh, error) {
	bin, err := Build()
	if err != nil {
		return nil, err
	}
	m := &Mesh{Dir: dataDir, Bin: bin, done: make(chan error, 1)}
	// Not CommandContext: Stop ends curfew up with SIGTERM so it can stop the services in order.
	args := []string{"up", "--data-dir", dataDir, "--base-port", "0", "--bin-dir", bin, "--json"}
	if o.Insecure {
		args = append(args, "--insecure")
	}
	args = append(args, o.Args...)
	m.up = exec.Command(filepath.Join(bin, "curfew"), args...) //nolint:noctx,gosec // see above; the curfew this package built
	m.up.Dir = o.Dir
	m.up.Env = append(os.Environ(), o.Env...)
	m.up.Stderr = os.Stderr
	if o.Stderr != nil {
		m.up.Stderr = o.Stderr
	}
	m.up.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGTERM}
	out, err := m.up.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := m.up.Start(); err != nil {
		return nil, err
	}
	ready := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(out)
		sent := false
		for sc.Scan() {
			if !sent && strings.Contains(sc.Text(), `"ready":true`) {
				ready <- nil
				sent = true
			}
		}
		if !sent {
			ready <- errors.New("curfew up exited before it was ready")
		}
	}()
	go func() { m.done <- m.up.Wait() }()
	select {
	case err := <-ready:
		if err != nil {
			return nil, err
		}
	case <-time.After(60 * time.Second):
		_ = m.Stop()
		return nil, errors.New("curfew up was not ready within 60s")
	case <-ctx.Done():
		_ = m.Stop()
		return nil, ctx.Err()
	}
	b, err := os.ReadFile(filepath.Join(dataDir, "endpoints.json")) //nolint:gosec // the test mesh's own data directory
	if err != nil {
		_ = m.Stop()
		return nil, err
	}
	if err := json.Unmarshal(b, &m.Endpoints); err != nil {
		_ = m.Stop()
		return nil, err
	}
	return m, nil
}

// Attach returns the mesh a running `curfew up` serves from dataDir (its
// endpoints.json), to call its services; Stop then closes the connections only.
func Attach(dataDir string) (*Mesh, error) {
	b, err := os.ReadFile(filepath.Join(dataDir, "endpoints.json")) //nolint:gosec // the data directory the caller named
	if err != nil {
		return nil, err
	}
	m := &Mesh{Dir: dataDir}
	if err := json.Unmarshal(b, &m.Endpoints); err != nil {
		return nil, fmt.Errorf("%s/endpoints.json: %w", dataDir, err)
	}
	return m, nil
}

// TLS reports whether the mesh runs mTLS.
func (m *Mesh) TLS() bool { return m.Endpoints.TLSDir != "" }

// Conn returns a client connection to a service ("orchestrator", "modelproxy", ...): as
// curfew-cli when the mesh runs mTLS, else plaintext.
func (m *Mesh) Conn(service string) (*grpc.ClientConn, error) {
	return m.ConnAs(meshtls.CLI, service)
}

// ConnAs returns a client connection to a service presenting identity's certificate
// from the mesh's mTLS files. When the mesh runs plaintext, the connection sends the
// API key `curfew up --insecure` made for its CLI instead (DIR/cli.key).
func (m *Mesh) ConnAs(identity, service string) (*grpc.ClientConn, error) {
	if !m.TLS() {
		key, err := os.ReadFile(filepath.Join(m.Dir, "cli.key"))
		if err != nil {
			return nil, err
		}
		return m.ConnWith(service, insecure.NewCredentials(), grpc.WithPerRPCCredentials(apikey.Bearer(strings.TrimSpace(string(key)))))
	}
	src, err := meshtls.NewSource(m.Endpoints.TLSDir, identity)
	if err != nil {
		return nil, err
	}
	return m.ConnWith(service, meshtls.ClientCredentials(src, service))
}

// ConnWith returns a client connection to a service with the given credentials and
// options (grpc.WithPerRPCCredentials(apikey.Bearer(key)) for an API key, say).
func (m *Mesh) ConnWith(service string, creds credentials.TransportCredentials, opts ...grpc.DialOption) (*grpc.ClientConn, error) {
	ep, ok := m.Endpoints.Services[service]
	if !ok {
		return nil, fmt.Errorf("meshproc: no service %q", service)
	}
	c, err := grpc.NewClient(ep.Addr, append([]grpc.DialOption{grpc.WithTransportCredentials(creds)}, opts...)...)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	m.conns = append(m.conns, c)
	m.mu.Unlock()
	return c, nil
}

// Orchestrator returns a client of the orchestrator.
func (m *Mesh) Orchestrator() (orchestratorv1.OrchestratorServiceClient, error) {
	c, err := m.Conn("orchestrator")
	if err != nil {
		return nil, err
	}
	return orchestratorv1.NewOrchestratorServiceClient(c), nil
}

// Report returns the NodeReportService client of a service.
func (m *Mesh) Report(service string) (meshv1.NodeReportServiceClient, error) {
	c, err := m.Conn(service)
	if err != nil {
		return nil, err
	}
	return meshv1.NewNodeReportServiceClient(c), nil
}

// PIDs returns the service processes' ids by name.
func (m *Mesh) PIDs() map[string]int {
	out := map[string]int{}
	for n, e := range m.Endpoints.Services {
		out[n] = e.PID
	}
	return out
}

// Stop stops `curfew up` with SIGTERM (it stops the services in order) and waits.
func (m *Mesh) Stop() error {
	m.mu.Lock()
	for _, c := range m.conns {
		_ = c.Close()
	}
	m.conns = nil
	m.mu.Unlock()
	if m.up == nil || m.up.Process == nil {
		return nil // attached (Attach): not this package's to stop
	}
	_ = m.up.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-m.done:
		m.done <- err
		return err
	case <-time.After(60 * time.Second):
		_ = m.up.Process.Kill()
		return errors.New("curfew up did not stop within 60s")
	}
}
