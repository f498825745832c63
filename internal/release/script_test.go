package release_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// scripts/release.sh, run for real on a scratch clone of the repository: it refuses a
// version not of the form vX.Y.Z, a release without its CHANGELOG section and a version
// released already, and otherwise writes the image, commits it and tags the commit.
func TestReleaseScript(t *testing.T) {
	root := repo(t)
	meshproc.Tool(t, "buf")
	if _, err := os.Stat(filepath.Join(root, ".tools", "bin", "buf")); err != nil {
		t.Skip("the script uses the tools scripts/tools.sh installs into .tools: run it first")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	env := append(os.Environ(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@example.com",
		"GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@example.com")
	run := func(dir, name string, args ...string) (string, int) {
		t.Helper()
		cmd := exec.CommandContext(ctx, name, args...)
		cmd.Dir, cmd.Env = dir, env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		err := cmd.Run()
		if exit, ok := err.(*exec.ExitError); ok { //nolint:errorlint // exec returns it unwrapped
			return out.String(), exit.ExitCode()
		}
		if err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out.String())
		}
		return out.String(), 0
	}
	clone := filepath.Join(t.TempDir(), "curfew")
	if out, code := run(root, "git", "clone", "-q", "--no-hardlinks", root, clone); code != 0 {
		t.Fatalf("git clone: exit %d\n%s", code, out)
	}
	// The pinned tools as scripts/tools.sh installed them here: it finds them current.
	// (.tools itself stays a directory: .gitignore's /.tools/ matches no symlink.)
	for _, d := range []string{"bin", "node"} {
		if err := os.MkdirAll(filepath.Join(clone, ".tools"), 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(filepath.Join(root, ".tools", d), filepath.Join(clone, ".tools", d)); err != nil {
			t.Fatal(err)
		}
	}
	script := filepath.Join(clone, "scripts", "release.sh")

	if out, code := run(clone, "bash", script, "0.2"); code != 2 || !strings.Contains(out, "vMAJOR.MINOR.PATCH") {
		t.Errorf("release 0.2: exit %d, want 2 naming the form\n%s", code, out)
	}
	if out, code := run(clone, "bash", script, "v99.0.0"); code != 1 || !strings.Contains(out, "CHANGELOG.md has no section") {
		t.Errorf("release without a CHANGELOG section: exit %d, want 1\n%s", code, out)
	}

	changelog := filepath.Join(clone, "CHANGELOG.md")
	b, err := os.ReadFile(changelog)
	if err != nil {
		t.Fatal(err)
	}
	b = bytes.Replace(b, []byte("## [Unreleased]\n"), []byte("## [Unreleased]\n\n## [v99.0.0] - 2099-01-01\n"), 1)
	if err := os.WriteFile(changelog, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, code := run(clone, "git", "commit", "-q", "-am", "CHANGELOG: v99.0.0"); code != 0 {
		t.Fatalf("git commit: exit %d\n%s", code, out)
	}
	if out, code := run(clone, "bash", script, "v99.0.0"); code != 0 {
		t.Fatalf("release v99.0.0: exit %d\n%s", code, out)
	}
	if _, err := os.Stat(filepath.Join(clone, "proto", "releases", "v99.0.0.binpb")); err != nil {
		t.Errorf("no image: %v", err)
	}
	if out, _ := run(clone, "git", "describe", "--tags", "--exact-match", "HEAD"); strings.TrimSpace(out) != "v99.0.0" {
		t.Errorf("HEAD is tagged %q, want v99.0.0", strings.TrimSpace(out))
	}
	if out, _ := run(clone, "git", "status", "--porcelain"); strings.TrimSpace(out) != "" {
		t.Errorf("the release left the tree dirty:\n%s", out)
	}
	if out, code := run(clone, "bash", script, "v99.0.0"); code != 1 || !strings.Contains(out, "exists already") {
		t.Errorf("releasing v99.0.0 again: exit %d, want 1\n%s", code, out)
	}
}
