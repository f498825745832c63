package modelproxy

import (
	"os/exec"
	"strings"
	"testing"
)

// The drill's faults stay out of the core: they are wired in by main under --chaos
// (package internal/chaos), so neither that package nor mesh/chaos, which parses the
// fault switches, may be among this package's dependencies.
func TestCoreDoesNotDependOnChaos(t *testing.T) {
	// go test puts its own go first on the test's PATH.
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	forbidden := []string{
		"github.com/curfew-mesh/curfew/mesh/chaos",
		"github.com/curfew-mesh/curfew/services/modelproxy/internal/chaos",
	}
	deps := strings.Fields(string(out))
	if len(deps) < 10 || !strings.HasSuffix(deps[len(deps)-1], "/internal/modelproxy") {
		t.Fatalf("go list -deps printed %v, want this package's dependencies then itself", deps)
	}
	for _, d := range deps {
		for _, f := range forbidden {
			if d == f || strings.HasPrefix(d, f+"/") {
				t.Errorf("package modelproxy depends on %s: the drill's faults belong in internal/chaos, wired by main", d)
			}
		}
	}
}
