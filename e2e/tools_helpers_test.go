package e2e

import (
	"bytes"
	"context"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// Helpers of the registry-tool tests: a cluster whose toolrunner reads a tools file, the
// test MCP server and the Node ToolService server as real processes, and a TCP proxy that
// loses one reply.

// effectsRig is a cluster (meshproc.Cluster) whose toolrunner has --tools-config, with one
// orchestrator.
type effectsRig struct {
	c     *meshproc.Cluster
	tools *meshproc.Proc
	orch  *meshproc.Proc
	oc    orchestratorv1.OrchestratorServiceClient
}

// newEffectsRig starts the cluster with toolsJSON as toolrunner's tools file, waits until
// toolrunner has listed the sources named in wantUp, then starts an orchestrator whose
// --toolrunner is route(toolrunner's address) (nil: toolrunner itself).
func newEffectsRig(t *testing.T, toolsJSON string, wantUp []string, route func(toolrunner string) string) *effectsRig {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "curfew-tools-") // kept when the test fails, for the logs
	if err != nil {
		t.Fatal(err)
	}
	c, err := meshproc.NewCluster(t.Context(), dir, "sqlite://"+filepath.Join(dir, "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("cluster: %v", err)
		}
		if t.Failed() {
			t.Logf("process logs are in %s", dir)
		} else {
			_ = os.RemoveAll(dir)
		}
	})
	cfg := filepath.Join(dir, "tools.json")
	if err := os.WriteFile(cfg, []byte(toolsJSON), 0o600); err != nil {
		t.Fatal(err)
	}
	model, sub, tools, err := c.Mesh(ctx, map[string][]string{"toolrunner": {"--tools-config", cfg}})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range wantUp {
		waitLog(t, tools.Log, 30*time.Second, "tool source up", `"`+name+`"`)
	}
	args := c.OrchestratorArgs(model, sub, tools)
	if route != nil {
		for i := range args[:len(args)-1] {
			if args[i] == "--toolrunner" {
				args[i+1] = route(args[i+1])
			}
		}
	}
	orch, err := c.Add(ctx, "orchestrator", "orchestrator", args...)
	if err != nil {
		t.Fatal(err)
	}
	if err := orch.Start(ctx); err != nil {
		t.Fatal(err)
	}
	conn, err := c.Conn(orch)
	if err != nil {
		t.Fatal(err)
	}
	return &effectsRig{c: c, tools: tools, orch: orch, oc: orchestratorv1.NewOrchestratorServiceClient(conn)}
}

// waitLog waits until a line of the log at path holds every one of want.
func waitLog(t *testing.T, path string, within time.Duration, want ...string) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		b, _ := os.ReadFile(path) //nolint:gosec // the cluster's own log
		for line := range strings.SplitSeq(string(b), "\n") {
			ok := true
			for _, w := range want {
				ok = ok && strings.Contains(line, w)
			}
			if ok {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no line of %s holds %q within %v", path, want, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// mcptestServer builds internal/mcptest/cmd/curfew-mcptest into the test's directory and returns
// its path.
func mcptestServer(t *testing.T) string {
	t.Helper()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "curfew-mcptest")
	cmd := exec.Command("go", "build", "-o", bin, "./internal/mcptest/cmd/curfew-mcptest") //nolint:noctx // a bounded build of this repository's package
	cmd.Dir = repo
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building curfew-mcptest: %v\n%s", err, out)
	}
	return bin
}

// cutProxy forwards TCP connections to a target and, once, loses a reply: the first chunk
// from the target that holds marker (split over reads or not) is not forwarded, and its
// connection is closed both ways instead. Everything else passes unchanged.
type cutProxy struct {
	ln     net.Listener
	target string
	marker []byte
	onCut  func() int // runs at the cut, before the connection closes; its result is kept

	mu    sync.Mutex
	cuts  int
	atCut int // what onCut returned
	conns []net.Conn
	wg    sync.WaitGroup
}

// startCutProxy listens on a free loopback port; the test's end closes it.
func startCutProxy(t *testing.T, target, marker string, onCut func() int) *cutProxy {
	t.Helper()
	ln, err := new(net.ListenConfig).Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, target: target, marker: []byte(marker), onCut: onCut}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *cutProxy) addr() string { return p.ln.Addr().String() }

// cut says how many replies the proxy lost (0 or 1), and what onCut returned then.
func (p *cutProxy) cut() (cuts, atCut int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cuts, p.atCut
}

func (p *cutProxy) accept() {
	defer p.wg.Done()
	for {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			_ = down.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, down, up)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			_, _ = io.Copy(up, down)
			_ = up.Close()
		}()
		go func() {
			defer p.wg.Done()
			p.replies(down, up)
			_ = down.Close()
		}()
	}
}

// replies copies up's bytes to down until the marker passes (the first time), then
// closes both without forwarding the chunk that holds it.
func (p *cutProxy) replies(down, up net.Conn) {
	buf := make([]byte, 32*1024)
	var tail []byte // the last len(marker)-1 bytes forwarded, for a marker split over reads
	for {
		n, err := up.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			if p.cutHere(append(append([]byte(nil), tail...), chunk...)) {
				_ = up.Close()
				return
			}
			if _, werr := down.Write(chunk); werr != nil {
				return
			}
			tail = append(tail, chunk...)
			tail = tail[max(len(tail)-len(p.marker)+1, 0):]
		}
		if err != nil {
			return
		}
	}
}

func (p *cutProxy) cutHere(window []byte) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cuts > 0 || !bytes.Contains(window, p.marker) {
		return false
	}
	p.cuts++
	if p.onCut != nil {
		p.atCut = p.onCut()
	}
	return true
}

func (p *cutProxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// The Node ToolService server of examples/node-tool (see
// services/toolrunner/internal/source/grpctool/node_test.go): scripts/node.sh builds it;
// without Node.js the tests skip locally (meshproc.Missing) and fail under CI=true.

// executeAttempts counts the orchestrator's attempts of toolrunner's Execute with the
// outcome code ("Unavailable", "OK") that were retries (retry) or first attempts, from
// its curfew_retry_attempts_total.
func executeAttempts(t *testing.T, orch *meshproc.Proc, code string, retry bool) float64 {
	t.Helper()
	body, err := httpGet("http://" + orch.AdminAddr + "/metrics")
	if err != nil {
		t.Fatalf("orchestrator /metrics: %v", err)
	}
	var n float64
	for line := range strings.Lines(body) {
		if !strings.HasPrefix(line, "curfew_retry_attempts_total{") {
			continue
		}
		s, err := parseSample(strings.TrimSpace(line))
		if err != nil {
			t.Fatal(err)
		}
		if s.labels["target"] == "toolrunner" && strings.HasSuffix(s.labels["method"], "/Execute") &&
			s.labels["code"] == code && s.labels["retry"] == strconv.FormatBool(retry) {
			n += s.value
		}
	}
	return n
}
