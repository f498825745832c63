package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

const metricsHeader = `Golden file: the metric families %s serves on its admin /metrics after the
known runs of TestGoldenMetrics (%s), one per line: name, type, and its label names
sorted in braces. Label values are left out: they hold versions, methods and codes that the runs'
timing may vary. go_* and process_* are left out too: the Prometheus client's Go and
process collectors serve them, and their set changes with the Go release and the OS,
not with curfew.
Rewrite with: go test ./e2e/ -run Golden -count=1 -update (and say why in the commit).`

// goldenRuns runs, on m, the runs after which the metric families are golden: a run
// whose tool fails twice and is retried beside a subagent (models, tools, subagents,
// retries and backoff, breakers), a run its client cancels while a model, a tool and a
// subagent are busy (cancel propagation, orphan tokens), and a run of the model alias
// "agent" (on a mesh with providers it goes to the providers, which do not answer:
// fallbacks and the providers' breakers; elsewhere NOT_FOUND). Each run's end is
// awaited, so that what a run records is in place before the scrape.
func goldenRuns(t *testing.T, m *meshproc.Mesh) {
	t.Helper()
	ctx := context.Background()
	c, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	a, _ := runPlan(ctx, c, retriedToolPlan, 20*time.Second, 0, false)
	if a.err != nil || a.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("the retried run must succeed: %v %v", a.err, a.finished.GetStatus())
	}
	b, _ := runPlan(ctx, c, busyCancelPlan, 20*time.Second, 1500*time.Millisecond, false)
	if b.started == nil {
		t.Fatalf("the cancelled run never started: %v", b.err)
	}
	if s := summary(ctx, t, c, b.started.GetRunId()); s.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED {
		t.Fatalf("the run must be cancelled:\n%s", dump(s))
	}
	cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	st, err := c.Run(cctx, &orchestratorv1.RunRequest{Task: "say hello", Model: "agent"})
	if err != nil {
		t.Fatal(err)
	}
	var id string
	for {
		ev, err := st.Recv()
		if err != nil {
			break
		}
		if s := ev.GetStarted(); s != nil {
			id = s.GetRunId()
		}
	}
	if id != "" {
		summary(ctx, t, c, id)
	}
}

// families formats the families of one /metrics page (see metricsHeader).
func families(p page) string {
	var lines []string
	for name, mf := range p.mfs {
		if strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_") {
			continue
		}
		var labels []string
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if !slices.Contains(labels, l.GetName()) {
					labels = append(labels, l.GetName())
				}
			}
		}
		slices.Sort(labels)
		lines = append(lines, fmt.Sprintf("%s %s {%s}", name, strings.ToLower(mf.GetType().String()), strings.Join(labels, ",")))
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n") + "\n"
}

// The metric families, with their types and label names, that each service serves after
// the known runs are the golden ones: on a mesh as `curfew up` starts it (mTLS, a SQLite
// store), and modelproxy's on a mesh with a providers file. Each mesh is this test's
// own, so nothing another test ran shows. Not parallel: two more meshes beside the
// parallel tests would only slow them.
func TestGoldenMetrics(t *testing.T) {
	m := startOwnMesh(t)
	goldenRuns(t, m)
	for _, svc := range services {
		got := families(scrapeParsed(t, m, svc))
		golden(t, "metrics/"+svc+".txt", fmt.Sprintf(metricsHeader, svc, "a mesh as curfew up starts it"), got)
	}

	cfg := filepath.Join(t.TempDir(), "providers.json")
	if err := os.WriteFile(cfg, []byte(`{"providers": [
	    {"name": "primary", "base_url": "http://127.0.0.1:9/v1", "models": ["big"], "timeout": "1s"},
	    {"name": "backup", "base_url": "http://127.0.0.1:9/v1", "models": ["small"], "timeout": "1s"}],
	  "models": {"agent": {"chain": ["primary/big", "backup/small"], "degrade_to": "backup/small"}}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	pm := startOwnMesh(t, "CURFEW_PROVIDERS_CONFIG="+cfg)
	goldenRuns(t, pm)
	got := families(scrapeParsed(t, pm, "modelproxy"))
	golden(t, "metrics/modelproxy-with-providers.txt", fmt.Sprintf(metricsHeader, "modelproxy", "a mesh whose modelproxy has --providers-config with two unreachable providers"), got)
}
