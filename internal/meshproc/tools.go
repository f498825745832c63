package meshproc

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// Missing ends t for want of something the machine does not have (a tool, a service):
// it skips locally and fails under CI=true, where everything a test needs is installed.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
		return
	}
	t.Skip(msg)
}

// Tool returns the pinned tool name that scripts/tools.sh installs into .tools/bin, or
// one on PATH; without either it is Missing.
func Tool(t testing.TB, name string) string {
	t.Helper()
	repo, err := Repo()
	if err != nil {
		t.Fatal(err)
	}
	if p := filepath.Join(repo, ".tools", "bin", name); fileExists(p) {
		return p
	}
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	Missing(t, "%s not installed; scripts/tools.sh installs it", name)
	return ""
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
