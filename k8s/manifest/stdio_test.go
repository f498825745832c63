package manifest_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/buildkit/frontend/dockerfile/instructions"
)

// stdioDockerfile builds a toolrunner image that carries the runtime of MCP servers it
// starts over stdio; stdioTools is the tools.json that goes with it.
const (
	stdioDockerfile = "examples/toolrunner-stdio/Dockerfile"
	stdioTools      = "examples/toolrunner-stdio/tools.json"
)

// The image's layout, which stdioTools names: distroless nodejs keeps node at
// /nodejs/bin/node; the Dockerfile copies the installed packages under /opt/mcp.
const (
	imageNode    = "/nodejs/bin/node"
	imageModules = "/opt/mcp/node_modules"
)

// The stdio image is built like curfew's: toolrunner by the same go build, a runtime
// stage with no shell or package manager running as a numeric non-root user, HOME on the
// writable /tmp, and the servers installed at build time from a lock file (npm ci), so
// that nothing (no npx) fetches code at run time.
func TestToolrunnerStdioImageIsPinnedAndNonRoot(t *testing.T) {
	d := parseDockerfile(t, stdioDockerfile)
	if len(d.stages) < 3 {
		t.Fatalf("%d stage(s); want toolrunner's build, the servers' install and the runtime", len(d.stages))
	}
	final := d.stages[len(d.stages)-1]
	cmd := d.goBuild(t)
	for _, want := range []string{"CGO_ENABLED=0", "-trimpath", "-X " + versionVar + "=${VERSION}", "./services/toolrunner/cmd/toolrunner"} {
		if !strings.Contains(cmd, want) {
			t.Errorf("go build lacks %q: %s", want, cmd)
		}
	}
	if !strings.HasPrefix(final.BaseName, "gcr.io/distroless/nodejs") {
		t.Errorf("runtime image %s; want distroless nodejs (node, no shell, npm or npx)", final.BaseName)
	}
	var user, home string
	var copied []string
	for _, c := range final.Commands {
		switch c := c.(type) {
		case *instructions.UserCommand:
			user = c.User
		case *instructions.RunCommand:
			t.Errorf("RUN in the runtime stage: %v", c.CmdLine)
		case *instructions.EnvCommand:
			for _, kv := range c.Env {
				if kv.Key == "HOME" {
					home = kv.Value
				}
			}
		case *instructions.CopyCommand:
			if c.From == "" {
				t.Errorf("the runtime stage copies %v from the context; want only what the build stages made", c.SourcePaths)
			}
			copied = append(copied, c.DestPath)
		}
	}
	uid, _, _ := strings.Cut(user, ":")
	if n, err := strconv.Atoi(uid); err != nil || n == 0 {
		t.Errorf("USER %q; want a numeric non-root uid (runAsNonRoot can only check a number)", user)
	}
	// toolrunner's pod mounts an emptyDir at /tmp; everything else is read-only.
	if home != "/tmp" && !strings.HasPrefix(home, "/tmp/") {
		t.Errorf("HOME %q; want a directory under /tmp, the pod's only writable mount", home)
	}
	if !slices.Contains(copied, imageModules) {
		t.Errorf("the runtime stage copies to %v; tools.json runs the servers from %s", copied, imageModules)
	}
	if ep := d.entrypoint(t); filepath.Base(ep[0]) != "toolrunner" {
		t.Errorf("ENTRYPOINT %v; want toolrunner", ep)
	}
	lockInstall := false
	for _, st := range d.stages[1 : len(d.stages)-1] {
		for _, c := range st.Commands {
			switch c := c.(type) {
			case *instructions.RunCommand:
				line := strings.Join(c.CmdLine, " ")
				if strings.Contains(line, "npm ci") && strings.Contains(line, "--ignore-scripts") {
					lockInstall = true
				}
				if strings.Contains(line, "npm install") || strings.Contains(line, "npx") {
					t.Errorf("stage %s: %q; want npm ci from the lock file", st.Name, line)
				}
			case *instructions.CopyCommand:
				for _, src := range c.SourcePaths {
					if _, err := os.Stat(filepath.Join(repoRoot(t), src)); err != nil {
						t.Errorf("COPY %s: not in the repository", src)
					}
				}
			}
		}
	}
	if !lockInstall {
		t.Error("no stage installs the servers with npm ci --ignore-scripts (exact, integrity-checked versions from package-lock.json)")
	}

	f := parseTools(t, stdioTools, readRepoFile(t, stdioTools))
	if len(f.Sources) == 0 {
		t.Fatal(stdioTools + " names no source")
	}
	for _, src := range f.Sources {
		if src.Kind != "mcp_stdio" {
			continue
		}
		if src.Command != imageNode {
			t.Errorf("source %q: command %q; want the image's node, %s (npx would fetch at run time)", src.Name, src.Command, imageNode)
		}
		for _, a := range src.Args {
			if strings.HasPrefix(a, "/") && !strings.HasPrefix(a, imageModules+"/") {
				t.Errorf("source %q: argument %q is outside %s, where the image has its servers", src.Name, a, imageModules)
			}
		}
	}
}

// The image's tools.json starts its server: toolrunner, built by the Dockerfile's go
// build, runs the file (with the image's paths mapped to this machine's node and to the
// packages npm ci installs from the example's lock file) and its source comes up with
// tools. The server is the real one the lock file pins.
func TestToolrunnerStdioImageStartsItsServer(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		missing(t, "node is not on PATH")
	}
	npm, err := exec.LookPath("npm")
	if err != nil {
		missing(t, "npm is not on PATH")
	}
	dir := t.TempDir()
	mcp := filepath.Join(dir, "mcp")
	if err := os.MkdirAll(mcp, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"package.json", "package-lock.json"} {
		writeFile(t, filepath.Join(mcp, name), string(readRepoFile(t, "examples/toolrunner-stdio/"+name)))
	}
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	defer cancel()
	// The Dockerfile's install, from npm's cache when it has the packages.
	install := exec.CommandContext(ctx, npm, "ci", "--omit=dev", "--ignore-scripts", "--no-audit", "--no-fund", "--prefer-offline")
	install.Dir = mcp
	if out, err := install.CombinedOutput(); err != nil {
		missing(t, "npm ci of examples/toolrunner-stdio: %v\n%s", err, out)
	}

	bin := filepath.Join(dir, "toolrunner")
	if err := buildLikeDockerfile(t, stdioDockerfile, bin); err != nil {
		t.Fatal(err)
	}
	local := strings.NewReplacer(imageNode, node, imageModules+"/", filepath.Join(mcp, "node_modules")+"/")
	f := parseTools(t, stdioTools, readRepoFile(t, stdioTools))
	tools := filepath.Join(dir, "tools.json")
	writeFile(t, tools, local.Replace(string(readRepoFile(t, stdioTools))))

	home := filepath.Join(dir, "home")
	if err := os.MkdirAll(home, 0o700); err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, bin, "--insecure", "--addr="+freeAddr(t), "--admin-addr="+freeAddr(t),
		"--health-addr="+freeAddr(t), "--tools-config="+tools)
	cmd.Dir = home
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + home}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// A source that does not come up does not stop toolrunner: give it a bound.
	stop := time.AfterFunc(90*time.Second, func() { _ = cmd.Process.Signal(syscall.SIGTERM) })
	defer stop.Stop()
	up := map[string]int{}
	var logs []string
	lines := bufio.NewScanner(stderr)
	for len(up) < len(f.Sources) && lines.Scan() {
		logs = append(logs, lines.Text())
		var rec struct {
			Msg    string `json:"msg"`
			Source string `json:"source"`
			Tools  int    `json:"tools"`
		}
		if json.Unmarshal(lines.Bytes(), &rec) == nil && rec.Msg == "tool source up" {
			up[rec.Source] = rec.Tools
		}
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	go func() { _, _ = io.Copy(io.Discard, stderr) }()
	werr := cmd.Wait()
	for _, src := range f.Sources {
		if up[src.Name] == 0 {
			t.Errorf("source %q did not come up with tools (toolrunner: %v); its log:\n%s", src.Name, werr, strings.Join(logs, "\n"))
		} else {
			t.Logf("source %q up with %d tools", src.Name, up[src.Name])
		}
	}
	var exit *exec.ExitError
	if werr != nil && !errors.As(werr, &exit) {
		t.Errorf("toolrunner: %v", werr)
	} else if werr != nil {
		t.Errorf("toolrunner exited with %v after SIGTERM, want 0", werr)
	}
}

func readRepoFile(t *testing.T, rel string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), rel))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// missing skips a test whose tools this machine lacks, and fails it under CI=true, where
// scripts/test.sh provides them.
func missing(t *testing.T, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf(format, args...)
	}
	t.Skipf(format, args...)
}
