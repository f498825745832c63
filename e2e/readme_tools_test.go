package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// readmeBlock is a fenced block of README.md that a `<!-- readme-test: NAME -->` line
// marks, by NAME.
var readmeBlock = regexp.MustCompile("(?s)<!-- readme-test: (\\S+) -->\n```\\w*\n(.*?)```")

// readmeBlocks returns README.md's marked blocks by name (readmeBlock).
func readmeBlocks(t *testing.T) (repo string, blocks map[string]string) {
	t.Helper()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(repo, "README.md")) //nolint:gosec // the repository's README
	if err != nil {
		t.Fatal(err)
	}
	blocks = map[string]string{}
	for _, m := range readmeBlock.FindAllStringSubmatch(string(readme), -1) {
		blocks[m[1]] = m[2]
	}
	return repo, blocks
}

// TestReadmeToolsExample runs README.md's "Bring your own tools" example as written: its
// commands in order, from the repository's root, with its tools.json and plan.json, so
// that the example cannot rot. Only the data directory and the files' location are the
// test's own (the files live in a temporary directory, not the repository).
func TestReadmeToolsExample(t *testing.T) {
	repo, blocks := readmeBlocks(t)
	dir := t.TempDir()
	files := map[string]string{} // a name the commands use → where the test wrote it
	for _, name := range []string{"tools.json", "plan.json"} {
		if !json.Valid([]byte(blocks[name])) {
			t.Fatalf("README.md's block %q is missing or not JSON:\n%s", name, blocks[name])
		}
		files[name] = filepath.Join(dir, name)
		if err := os.WriteFile(files[name], []byte(blocks[name]), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	var cfg struct {
		Sources []struct {
			Name string `json:"name"`
		} `json:"sources"`
	}
	if err := json.Unmarshal([]byte(blocks["tools.json"]), &cfg); err != nil || len(cfg.Sources) == 0 {
		t.Fatalf("README.md's tools.json names no source: %v", err)
	}
	if _, err := exec.LookPath("node"); err != nil {
		meshproc.Missing(t, "node is not installed: README.md's tools example runs a Node MCP server")
	}

	// The commands, one a line: each is one the test knows how to run, else it fails, so
	// that the README cannot gain a step this test skips.
	var upArgs, runArgs []string
	for line := range strings.Lines(blocks["commands"]) {
		line, _, _ = strings.Cut(line, "#")
		f := strings.Fields(strings.TrimSuffix(strings.TrimSpace(line), "&"))
		for i, a := range f {
			if p, ok := files[a]; ok {
				f[i] = p
			}
		}
		switch {
		case len(f) == 0:
		case strings.Join(f, " ") == "bash scripts/node.sh mcp":
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			cmd := exec.CommandContext(ctx, "bash", "scripts/node.sh", "mcp")
			cmd.Dir = repo
			out, err := cmd.CombinedOutput()
			cancel()
			if err != nil {
				t.Fatalf("scripts/node.sh mcp: %v\n%s", err, out)
			}
		case len(f) >= 2 && f[0] == "curfew" && f[1] == "up":
			upArgs = f[2:]
		case len(f) >= 2 && f[0] == "curfew" && f[1] == "run":
			runArgs = f[2:]
		default:
			t.Fatalf("README.md's tools example has a command this test does not run: %q", line)
		}
	}
	if upArgs == nil || runArgs == nil {
		t.Fatalf("README.md's tools example lacks curfew up or curfew run:\n%s", blocks["commands"])
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	data := t.TempDir()
	m, err := meshproc.Start(ctx, data, meshproc.Options{Args: upArgs, Dir: repo})
	if err != nil {
		t.Fatalf("curfew up %s: %v", strings.Join(upArgs, " "), err)
	}
	t.Cleanup(func() {
		if err := m.Stop(); err != nil {
			t.Errorf("curfew up did not stop cleanly: %v", err)
		}
	})
	// toolrunner lists its sources in the background: a source still starting would fail
	// its tools UNAVAILABLE.
	for _, s := range cfg.Sources {
		waitLog(t, filepath.Join(data, "logs", "toolrunner.log"), 60*time.Second, "tool source up", `"`+s.Name+`"`)
	}

	cmd := exec.Command(filepath.Join(m.Bin, "curfew"), append(append([]string{"run"}, runArgs...), "--data-dir", data)...) //nolint:noctx // bounded by the run's own deadline
	cmd.Dir = repo
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("curfew run %s: %v\n%s%s", strings.Join(runArgs, " "), err, out.String(), errb.String())
	}
	// The run succeeded, and its tool node is the README's source__tool call, which ran on
	// the MCP server (toolrunner's own record of the node).
	var runID string
	if f := strings.Fields(out.String()); len(f) >= 3 && f[0] == "run" && f[2] == "started," {
		runID = f[1]
	}
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	resp, err := oc.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: runID})
	if err != nil {
		t.Fatalf("GetRun %q: %v\n%s", runID, err, out.String())
	}
	r := resp.GetRun()
	n := nodeMap(r)["root/s0.t0"]
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED ||
		!strings.HasPrefix(n.GetName(), cfg.Sources[0].Name+"__") || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Fatalf("run %s, tool node %q %s; want the README's tool call succeeded\n%s", r.GetStatus(), n.GetName(), n.GetStatus(), dump(r))
	}
	t.Logf("README's example ran %s: %s", n.GetName(), n.GetStatus())
}
