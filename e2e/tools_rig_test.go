package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// The tool-source rig: a cluster (modelproxy, subagent, toolrunner, one orchestrator on
// a SQLite store) whose toolrunner runs with --tools-config, and the MCP servers its
// sources name: the repository's curfew-mcptest and the pinned reference server
// @modelcontextprotocol/server-everything, each a real process.

var (
	mcptestOnce sync.Once
	mcptestDir  string
	mcptestErr  error
)

// mcptestBin builds internal/mcptest/cmd/curfew-mcptest once per test process and
// returns its path; removeMCPTest deletes it at the end (TestMain).
func mcptestBin(t *testing.T) string {
	t.Helper()
	mcptestOnce.Do(func() {
		repo, err := meshproc.Repo()
		if err != nil {
			mcptestErr = err
			return
		}
		if mcptestDir, mcptestErr = os.MkdirTemp("", "curfew-mcptest-"); mcptestErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-o", filepath.Join(mcptestDir, "curfew-mcptest"), "./internal/mcptest/cmd/curfew-mcptest") //nolint:noctx // a bounded build of this repository's package
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			mcptestErr = fmt.Errorf("building curfew-mcptest: %w\n%s", err, out)
		}
	})
	if mcptestErr != nil {
		t.Fatal(mcptestErr)
	}
	return filepath.Join(mcptestDir, "curfew-mcptest")
}

func removeMCPTest() {
	if mcptestDir != "" {
		_ = os.RemoveAll(mcptestDir)
	}
}

// everything returns node and the entry point of server-everything as scripts/node.sh
// mcp installs it; Missing (skip locally, fail under CI) without either.
func everything(t *testing.T) (node, entry string) {
	t.Helper()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	entry = filepath.Join(repo, ".tools", "mcp-everything", "node_modules", "@modelcontextprotocol", "server-everything", "dist", "index.js")
	if _, err := os.Stat(entry); err != nil {
		meshproc.Missing(t, "server-everything not installed (%v); scripts/node.sh mcp installs it", err)
	}
	node, err = exec.LookPath("node")
	if err != nil {
		meshproc.Missing(t, "node not on PATH; scripts/node.sh installs it under CI")
	}
	return node, entry
}

// startEverythingHTTP runs server-everything over streamable HTTP on a free loopback
// port until the test ends, and returns its endpoint once it listens.
func startEverythingHTTP(t *testing.T) string {
	t.Helper()
	node, entry := everything(t)
	for attempt := 1; ; attempt++ {
		port := freePort(t)
		cmd := exec.Command(node, entry, "streamableHttp") //nolint:noctx // stopped by the cleanup below
		cmd.Env = append(os.Environ(), "PORT="+strconv.Itoa(port))
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		stderr, err := cmd.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
		listening, lines := make(chan bool, 1), make(chan string, 64)
		go func() {
			sc := bufio.NewScanner(stderr)
			sent := false
			for sc.Scan() {
				select {
				case lines <- sc.Text():
				default:
				}
				if !sent && strings.Contains(sc.Text(), "listening on port") {
					listening <- true
					sent = true
				}
			}
			if !sent {
				listening <- false // exited: the port was taken meanwhile, say
			}
		}()
		select {
		case ok := <-listening:
			if ok {
				return fmt.Sprintf("http://127.0.0.1:%d/mcp", port)
			}
			if attempt == 3 {
				t.Fatalf("server-everything streamableHttp exited at start: %s", drain(lines))
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("server-everything streamableHttp did not listen within 20s: %s", drain(lines))
		}
	}
}

func drain(lines chan string) string {
	var out []string
	for {
		select {
		case l := <-lines:
			out = append(out, l)
		default:
			return strings.Join(out, " | ")
		}
	}
}

// freePort returns a loopback port nothing listens on now.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// toolsRig is a cluster (meshproc.Cluster) on its own SQLite store whose toolrunner reads
// a tools file, with one orchestrator.
type toolsRig struct {
	t        *testing.T
	c        *meshproc.Cluster
	tools    *meshproc.Proc
	orchProc *meshproc.Proc
	orch     orchestratorv1.OrchestratorServiceClient
	st       store.Store
}

// newToolsRig starts a cluster whose toolrunner reads a tools file of sources (the JSON
// array of its "sources").
func newToolsRig(t *testing.T, sources string) *toolsRig {
	return newToolsRigVia(t, sources, nil)
}

// newToolsRigVia is newToolsRig with the orchestrator's --toolrunner set to
// route(toolrunner's address) (a proxy that loses a reply, say); nil routes nothing.
func newToolsRigVia(t *testing.T, sources string, route func(toolrunner string) string) *toolsRig {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "curfew-tools-") // kept when the test fails, for the logs
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "tools.json")
	if err := os.WriteFile(cfg, []byte(`{"sources": `+sources+`}`), 0o600); err != nil {
		t.Fatal(err)
	}
	dsn := "sqlite://" + filepath.Join(dir, "curfew.db")
	c, err := meshproc.NewCluster(t.Context(), dir, dsn)
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
	r := &toolsRig{t: t, c: c}
	var model, sub *meshproc.Proc
	model, sub, r.tools, err = c.Mesh(ctx, map[string][]string{"toolrunner": {"--tools-config", cfg}})
	if err != nil {
		t.Fatal(err)
	}
	args := c.OrchestratorArgs(model, sub, r.tools)
	for i := range args[:len(args)-1] {
		if args[i] == "--toolrunner" && route != nil {
			args[i+1] = route(args[i+1])
		}
	}
	o, err := c.Add(ctx, "orchestrator", "orchestrator", args...)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Start(ctx); err != nil {
		t.Fatal(err)
	}
	r.orchProc = o
	conn, err := c.Conn(o)
	if err != nil {
		t.Fatal(err)
	}
	r.orch = orchestratorv1.NewOrchestratorServiceClient(conn)
	r.st, err = store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.st.Close() })
	return r
}

// waitLog waits until toolrunner's log has a line (JSON) that match accepts, from the
// from'th line on, and returns the number of lines read.
func (r *toolsRig) waitLog(from int, within time.Duration, what string, match func(map[string]any) bool) int {
	r.t.Helper()
	deadline := time.Now().Add(within)
	for {
		data, err := os.ReadFile(r.tools.Log)
		if err != nil {
			r.t.Fatal(err)
		}
		lines := strings.Split(string(data), "\n")
		for i := from; i < len(lines); i++ {
			var m map[string]any
			if json.Unmarshal([]byte(lines[i]), &m) == nil && match(m) {
				return i + 1
			}
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("toolrunner did not log %s within %v", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// logLines returns how many lines toolrunner's log has now.
func (r *toolsRig) logLines() int {
	r.t.Helper()
	data, err := os.ReadFile(r.tools.Log)
	if err != nil {
		r.t.Fatal(err)
	}
	return strings.Count(string(data), "\n")
}

// waitSource waits until toolrunner logs that source listed its tools (msg "tool
// source up"), so that a run calls a known tool.
func (r *toolsRig) waitSource(name string) {
	r.t.Helper()
	r.waitLog(0, 20*time.Second, "tool source up for "+name, func(m map[string]any) bool {
		return m["msg"] == "tool source up" && m["source"] == name
	})
}

// toolOutputs returns the outputs of the run's tool calls from its journal, in order.
func (r *toolsRig) toolOutputs(runID string) []string {
	r.t.Helper()
	cps, err := r.st.ListCheckpoints(context.Background(), md.DefaultTenant, runID)
	if err != nil {
		r.t.Fatal(err)
	}
	var out []string
	for _, c := range cps {
		if len(c.ToolResults) == 0 {
			continue
		}
		e, err := agent.UnmarshalEntry(c.ToolResults)
		if err != nil {
			r.t.Fatal(err)
		}
		out = append(out, e.ToolOutputs...)
	}
	return out
}

// metric reads one counter (summed over the series matching labels) from toolrunner's
// admin /metrics.
func (r *toolsRig) metric(name string, labels map[string]string) float64 {
	r.t.Helper()
	body, err := httpGet("http://" + r.tools.AdminAddr + "/metrics")
	if err != nil {
		r.t.Fatalf("toolrunner /metrics: %v", err)
	}
	return parsePage(r.t, body).value(name, labels, false)
}

// children returns the process ids of pid's children.
func children(t *testing.T, pid int) []int {
	t.Helper()
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, f := range tasks {
		data, err := os.ReadFile(f) //nolint:gosec // procfs
		if err != nil {
			continue // the thread ended meanwhile
		}
		for _, s := range strings.Fields(string(data)) {
			if n, err := strconv.Atoi(s); err == nil {
				out = append(out, n)
			}
		}
	}
	return out
}
