package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// docRecipes returns the sh block that follows the "grpcurl-recipes" marker in
// docs/api.md, so that the recipes this test runs are the ones the docs show.
func docRecipes(t *testing.T, repo string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repo, "docs", "api.md"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("(?s)<!-- grpcurl-recipes[^>]*-->\\s*```sh\\n(.*?)```").FindSubmatch(b)
	if m == nil {
		t.Fatal("docs/api.md has no ```sh block after <!-- grpcurl-recipes -->")
	}
	return string(m[1])
}

// The grpcurl recipes of docs/api.md (health, listing runs, starting and cancelling a run), all
// through server reflection, run as written against the mesh. grpcurl is pinned and
// installed into .tools/bin by scripts/tools.sh; without it the test skips locally and
// fails under CI=true.
func TestGrpcurlRecipes(t *testing.T) {
	t.Parallel()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	meshproc.Tool(t, "grpcurl")
	tools := filepath.Join(repo, ".tools", "bin")
	script := docRecipes(t, repo)
	for _, want := range []string{"grpc.health.v1.Health/Check", "/ListRuns", "/StartRun", "/CancelRun"} {
		if !strings.Contains(script, want) {
			t.Errorf("the recipes of docs/api.md lack %s", want)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", script)
	cmd.Env = append(os.Environ(), "PATH="+tools+string(os.PathListSeparator)+os.Getenv("PATH"),
		"CURFEW_ADDR="+mesh.Endpoints.Services["orchestrator"].Addr, "CURFEW_TLS="+mesh.Endpoints.TLSDir)
	out, err := cmd.CombinedOutput()
	t.Logf("recipes:\n%s\noutput:\n%s", script, out)
	if err != nil {
		t.Fatalf("the recipes of docs/api.md failed: %v", err)
	}
	s := string(out)
	for _, want := range []string{`"status": "SERVING"`, `"runs": [`, `"created": true`, `"RUN_STATUS_CANCELLED"`, `"CANCEL_CAUSE_OPERATOR"`} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %s", want)
		}
	}
	id := regexp.MustCompile(`"runId": "([^"]+)"`).FindAllStringSubmatch(s, -1)
	if len(id) == 0 {
		t.Fatal("no runId in the output")
	}
	r := summary(ctx, t, client(t), id[len(id)-1][1])
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
		t.Errorf("the recipe's run ended %s, want cancelled:\n%s", r.GetStatus(), dump(r))
	}
}
