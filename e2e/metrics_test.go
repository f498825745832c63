package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

var services = []string{"orchestrator", "toolrunner", "subagent", "modelproxy"}

// docRow is one metric row of docs/metrics.md.
type docRow struct {
	names     []string
	where     []string // services named in the "where" column
	any       bool     // served by at least one of where, not necessarily all
	providers bool     // served only with --providers-config
	tls       bool     // served only with --tls-dir
	tools     bool     // served only with --tools-config (checked by the registry's tests)
	reload    bool     // served only with a reloadable file (checked by reload_test.go)
	nats      bool     // served only with --nats (checked by e2e/outbox_test.go)
	hedge     bool     // served only with --hedge-max-extra-load, once a tool call was hedged (mesh/hedge's and mesh/agent's tests)
	budget    bool     // served only by a modelproxy with a shared store and a tenant budget (mesh/budget's and e2e/budget_cluster_test.go's tests)
	cluster   bool     // served only with coordination across replicas (admission, retry windows, probe leases), which curfew up on its own store leaves off
	planned   bool     // in the "Planned" table: not served yet
}

var (
	backticked = regexp.MustCompile("`([a-z_:][a-z0-9_:]*)`")
	parens     = regexp.MustCompile(`\([^)]*\)`)
)

// docMetrics parses the metric tables of docs/metrics.md.
func docMetrics(t *testing.T) []docRow {
	t.Helper()
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(repo, "docs", "metrics.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var rows []docRow
	planned, known := false, false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "## ") {
			planned = strings.HasPrefix(line, "## Planned")
			known = strings.HasPrefix(line, "## Known in advance") // series, read by docKnown
			continue
		}
		if known || !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), "|")
		r := docRow{planned: planned}
		for _, m := range backticked.FindAllStringSubmatch(cells[0], -1) {
			r.names = append(r.names, m[1])
		}
		// Services in parentheses serve it only under a condition the test does not
		// set up; "any of" means at least one of those named.
		where := parens.ReplaceAllString(cells[len(cells)-1], "")
		r.any = strings.Contains(where, "any of")
		if strings.Contains(where, "every service") {
			r.where = services
		} else {
			for _, s := range services {
				if strings.Contains(where, s) {
					r.where = append(r.where, s)
				}
			}
		}
		r.providers = strings.Contains(where, "--providers-config")
		r.tls = strings.Contains(where, "--tls-dir")
		r.tools = strings.Contains(where, "--tools-config")
		r.reload = strings.Contains(where, "a reloadable file")
		r.nats = strings.Contains(where, "--nats")
		r.hedge = strings.Contains(where, "--hedge-max-extra-load")
		r.budget = strings.Contains(where, "shared `--store` and a budget")
		r.cluster = strings.Contains(where, "coordination across replicas on")
		if len(r.names) == 0 || (!planned && len(r.where) == 0) {
			t.Fatalf("docs/metrics.md: cannot read the row %q", line)
		}
		rows = append(rows, r)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if len(rows) < 20 {
		t.Fatalf("docs/metrics.md: only %d metric rows found", len(rows))
	}
	return rows
}

// page is one /metrics page as the official parser read it.
type page struct {
	raw string
	mfs map[string]*dto.MetricFamily
}

// scrapeParsed reads a service's /metrics and parses it with the Prometheus text parser.
func scrapeParsed(t *testing.T, m *meshproc.Mesh, service string) page {
	t.Helper()
	body, err := httpGet("http://" + m.Endpoints.Services[service].AdminAddr + "/metrics")
	if err != nil {
		t.Fatalf("%s /metrics: %v", service, err)
	}
	return parsePage(t, body)
}

// parsePage parses a /metrics page with the Prometheus text parser.
func parsePage(t *testing.T, body string) page {
	t.Helper()
	p := expfmt.NewTextParser(model.LegacyValidation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("/metrics does not parse: %v", err)
	}
	return page{raw: body, mfs: mfs}
}

// value sums the series of family name whose labels include match: counter and gauge
// values, a histogram's sample count (or its sum with sumOf).
func (p page) value(name string, match map[string]string, sumOf bool) float64 {
	mf := p.mfs[name]
	if mf == nil {
		return 0
	}
	var total float64
series:
	for _, m := range mf.GetMetric() {
		for k, v := range match {
			ok := false
			for _, lp := range m.GetLabel() {
				if lp.GetName() == k && lp.GetValue() == v {
					ok = true
				}
			}
			if !ok {
				continue series
			}
		}
		switch {
		case m.GetCounter() != nil:
			total += m.GetCounter().GetValue()
		case m.GetGauge() != nil:
			total += m.GetGauge().GetValue()
		case m.GetHistogram() != nil && sumOf:
			total += m.GetHistogram().GetSampleSum()
		case m.GetHistogram() != nil:
			total += float64(m.GetHistogram().GetSampleCount())
		}
	}
	return total
}

// promtool returns the promtool to check pages with; "" (after skipping the check) when
// there is none outside CI. scripts/test.sh sets CURFEW_PROMTOOL.
func promtool(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("CURFEW_PROMTOOL"); p != "" {
		return p
	}
	if p, err := exec.LookPath("promtool"); err == nil {
		return p
	}
	if os.Getenv("CI") == "true" {
		t.Fatal("promtool not found: scripts/test.sh sets CURFEW_PROMTOOL (scripts/promtool.sh)")
	}
	t.Log("promtool not found (set CURFEW_PROMTOOL, see scripts/promtool.sh): skipping `promtool check metrics`")
	return ""
}

// checkMetrics runs `promtool check metrics` on a page: it fails on malformed text and
// lint problems (missing help, bad names, counters without _total, ...).
func checkMetrics(t *testing.T, tool, service, body string) {
	t.Helper()
	if tool == "" {
		return
	}
	cmd := exec.Command(tool, "check", "metrics")
	cmd.Stdin = strings.NewReader(body)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics on %s: %v\n%s", service, err, out)
	}
}

// retriedToolPlan is a run whose tool fails twice, beside a subagent; it succeeds on the
// tool's third attempt.
const retriedToolPlan = `{"tokens_per_second": 1000, "steps": [
  {"think_tokens": 3, "tools": [{"name": "fail", "args": {"times": 2}},
    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 1000, "steps": [{"answer_tokens": 4}]}}}]},
  {"answer_tokens": 2}]}`

// busyCancelPlan is a run whose model, tool (a 20 s sleep) and subagent are all busy
// long after its client cancels it (these tests cancel at 1.5 s).
const busyCancelPlan = `{"tokens_per_second": 40, "steps": [
  {"think_tokens": 10, "tools": [{"name": "sleep", "args": {"ms": 20000}},
    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 40, "steps": [{"answer_tokens": 800}]}}}]},
  {"answer_tokens": 10}]}`

// After a run with a retried tool and a subagent, and a run cancelled by its client,
// every service's /metrics parses with the Prometheus text parser and passes `promtool
// check metrics`, every metric docs/metrics.md lists is served where the doc says, and
// the figures match the runs: attempts (orchestrator's retry counter, its gRPC client
// count of logical calls, toolrunner's gRPC server count), tokens and orphan tokens
// (modelproxy's counters against the runs' summaries), cancel propagation (one
// observation at least per executor, each within the bound), deadline slack (the Run
// calls' deadline, never more). Not parallel: the deltas must be this test's own.
func TestMetricsAfterRuns(t *testing.T) {
	rows := docMetrics(t)
	tool := promtool(t)
	ctx := context.Background()
	c := client(t)
	before := map[string]page{}
	for _, s := range services {
		before[s] = scrapeParsed(t, mesh, s)
	}

	// Run A: a tool that fails twice, and a subagent, beside each other.
	resA, _ := runPlan(ctx, c, retriedToolPlan, 20*time.Second, 0, false)
	if resA.err != nil {
		t.Fatalf("run A: %v", resA.err)
	}
	a := finishedRun(ctx, t, c, resA)
	if a.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || nodeMap(a)["root/s0.t0"].GetAttempt() != 3 {
		t.Fatalf("run A must succeed with its fail tool on attempt 3:\n%s", dump(a))
	}
	// Run B: decoders, a sleeping tool and a subagent, cancelled by its client at 1.5 s.
	resB, _ := runPlan(ctx, c, busyCancelPlan, 20*time.Second, 1500*time.Millisecond, false)
	if resB.started == nil {
		t.Fatalf("run B never started: %v", resB.err)
	}
	b := summary(ctx, t, c, resB.started.GetRunId())
	if b.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || b.GetCancelledAt() == nil {
		t.Fatalf("run B must be cancelled:\n%s", dump(b))
	}

	after := map[string]page{}
	for _, s := range services {
		after[s] = scrapeParsed(t, mesh, s)
		checkMetrics(t, tool, s, after[s].raw)
	}

	// Every documented metric is served, where the doc says.
	var withProviders []docRow
	for _, r := range rows {
		if r.planned {
			for _, n := range r.names {
				for _, s := range services {
					if after[s].mfs[n] != nil {
						t.Errorf("%s is listed as planned in docs/metrics.md but %s serves it: move it to its table", n, s)
					}
				}
			}
			continue
		}
		if r.providers && !r.cluster {
			withProviders = append(withProviders, r)
			continue
		}
		if r.tls && !mesh.TLS() || r.tools || r.reload || r.nats || r.hedge || r.budget || r.cluster {
			continue
		}
		for _, n := range r.names {
			var serving []string
			for _, s := range r.where {
				if after[s].mfs[n] != nil {
					serving = append(serving, s)
				} else if !r.any {
					t.Errorf("%s: docs/metrics.md says %s serves it, but its /metrics lacks it", n, s)
				}
			}
			if r.any && len(serving) == 0 {
				t.Errorf("%s: docs/metrics.md says one of %v serves it, but none does", n, r.where)
			}
		}
	}
	// ... and every curfew_ metric served is documented, with help text.
	documented := map[string]bool{}
	for _, r := range rows {
		for _, n := range r.names {
			documented[n] = true
		}
	}
	for _, s := range services {
		for name, mf := range after[s].mfs {
			if (strings.HasPrefix(name, "curfew_") || strings.HasPrefix(name, "grpc_")) && !documented[name] {
				t.Errorf("%s serves %s, which docs/metrics.md does not list", s, name)
			}
			if strings.HasPrefix(name, "curfew_") && mf.GetHelp() == "" {
				t.Errorf("%s has no help text", name)
			}
		}
	}

	delta := func(svc, name string, match map[string]string) float64 {
		return after[svc].value(name, match, false) - before[svc].value(name, match, false)
	}
	// Attempts: the orchestrator's tool calls are the runs' root-level tool nodes; each
	// attempt of them reached toolrunner (the subagents' plans call no tools).
	var logical, attempts float64
	for _, r := range []*orchestratorv1.Run{a, b} {
		for _, n := range r.GetNodes() {
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL && strings.Count(n.GetId(), "/") == 1 {
				logical++
				attempts += float64(len(n.GetEarlierAttempts()) + 1)
			}
		}
	}
	execLbl := map[string]string{"target": "toolrunner", "method": executeMethod}
	if got := delta("orchestrator", "curfew_retry_attempts_total", execLbl); got != attempts || attempts != logical+2 {
		t.Errorf("orchestrator counted %v attempts to toolrunner, the runs' tool nodes show %v in %v calls (2 retries)", got, attempts, logical)
	}
	execLbl["retry"] = "true"
	if got := delta("orchestrator", "curfew_retry_attempts_total", execLbl); got != 2 {
		t.Errorf("orchestrator counted %v retries to toolrunner, want 2", got)
	}
	grpcExec := map[string]string{"grpc_service": "curfew.toolrunner.v1.ToolRunnerService", "grpc_method": "Execute"}
	if got := delta("orchestrator", "grpc_client_started_total", grpcExec); got != logical {
		t.Errorf("orchestrator's grpc_client_started_total{Execute} rose by %v, want %v logical calls", got, logical)
	}
	if got := delta("toolrunner", "grpc_server_started_total", grpcExec); got != attempts {
		t.Errorf("toolrunner's grpc_server_started_total{Execute} rose by %v, want %v attempts", got, attempts)
	}
	grpcExec["grpc_code"] = "Unavailable"
	if got := delta("toolrunner", "grpc_server_handled_total", grpcExec); got != 2 {
		t.Errorf("toolrunner handled %v Execute attempts with Unavailable, want 2", got)
	}
	// Tokens and orphan tokens: the decoders' ledger, as the summaries show it.
	sim := map[string]string{"model": "sim", "provider": "sim"}
	if got, want := delta("modelproxy", "curfew_model_tokens_total", sim), float64(a.GetTokens()+b.GetTokens()); got != want || want == 0 {
		t.Errorf("modelproxy counted %v tokens, the runs' summaries %v", got, want)
	}
	if got, want := delta("modelproxy", "curfew_model_orphan_tokens_total", sim), float64(a.GetTokensAfterCancel()+b.GetTokensAfterCancel()); got != want {
		t.Errorf("modelproxy counted %v orphan tokens, the runs' summaries %v", got, want)
	}
	// Cancel propagation: each executor observed run B's cancelled nodes, within the bound.
	const bound = 750 * time.Millisecond
	for svc, kind := range map[string]string{"modelproxy": "model", "toolrunner": "tool", "subagent": "subagent"} {
		k := map[string]string{"kind": kind}
		n := delta(svc, "curfew_cancel_propagation_seconds", k)
		sum := after[svc].value("curfew_cancel_propagation_seconds", k, true) - before[svc].value("curfew_cancel_propagation_seconds", k, true)
		if n < 1 || sum < 0 || sum > n*bound.Seconds() {
			t.Errorf("%s observed %v cancel propagations of %s nodes totalling %.3fs, want at least 1, each within %v", svc, n, kind, sum, bound)
		}
	}
	// Deadline slack: the two Run calls arrived with at most their 20 s.
	run := map[string]string{"method": orchestratorv1.OrchestratorService_Run_FullMethodName}
	n := delta("orchestrator", "curfew_deadline_slack_seconds", run)
	sum := after["orchestrator"].value("curfew_deadline_slack_seconds", run, true) - before["orchestrator"].value("curfew_deadline_slack_seconds", run, true)
	if n != 2 || sum > 40 || sum < 30 {
		t.Errorf("orchestrator observed %v Run slacks totalling %.3fs, want 2 of a little under 20 s", n, sum)
	}
	if t.Failed() {
		t.Logf("run A:\n%s\nrun B:\n%s", dump(a), dump(b))
	}

	// The metrics of a modelproxy with providers exist before any model call (their
	// series start at 0); its providers are never called here.
	pm := startProviderMesh(t, `{"providers": [{"name": "primary", "base_url": "http://127.0.0.1:9/v1", "models": ["big"]},
	    {"name": "backup", "base_url": "http://127.0.0.1:9/v1", "models": ["small"]}],
	  "models": {"agent": {"chain": ["primary/big"], "degrade_to": "backup/small"}}}`, nil)
	mp := scrapeParsed(t, pm, "modelproxy")
	checkMetrics(t, tool, "modelproxy (with providers)", mp.raw)
	for _, r := range withProviders {
		for _, name := range r.names {
			if mp.mfs[name] == nil {
				t.Errorf("%s: a modelproxy with --providers-config does not serve it", name)
			}
		}
	}
	if got := mp.value("curfew_model_fallbacks_total", map[string]string{"alias": "agent", "provider": "backup", "reason": "timeout"}, false); got != 0 ||
		mp.mfs["curfew_model_fallbacks_total"] == nil || len(mp.mfs["curfew_model_fallbacks_total"].GetMetric()) != 2*7 {
		t.Errorf("fallbacks must start at 0 for each of agent's 2 providers and 7 reasons: %v", mp.mfs["curfew_model_fallbacks_total"])
	}
}

// The alerting rules and the dashboard query only metrics docs/metrics.md lists (the
// planned ones included: the dead-letter rule is written ahead of its metric).
func TestMonitoringUsesDocumentedMetrics(t *testing.T) {
	t.Parallel()
	documented := map[string]bool{}
	for _, r := range docMetrics(t) {
		for _, n := range r.names {
			documented[n] = true
		}
	}
	repo, err := meshproc.Repo()
	if err != nil {
		t.Fatal(err)
	}
	metricName := regexp.MustCompile(`\b((?:curfew|grpc)_[a-z0-9_]+)`)
	for _, f := range []string{"curfew-alerts.yml", "curfew-dashboard.json"} {
		b, err := os.ReadFile(filepath.Join(repo, "k8s", "components", "prometheus", f))
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasSuffix(f, ".json") {
			var v map[string]any
			if err := json.Unmarshal(b, &v); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
		}
		seen := 0
		for _, m := range metricName.FindAllStringSubmatch(string(b), -1) {
			name := m[1]
			for _, suffix := range []string{"_bucket", "_sum", "_count"} {
				if base := strings.TrimSuffix(name, suffix); base != name && documented[base] {
					name = base
				}
			}
			if documented[name] {
				seen++
				continue
			}
			if name == "grpc_code" || name == "grpc_method" || name == "grpc_service" || name == "grpc_type" {
				continue // labels
			}
			t.Errorf("%s uses %s, which docs/metrics.md does not list", f, name)
		}
		if seen < 5 {
			t.Errorf("%s: only %d metric references found", f, seen)
		}
	}
}
