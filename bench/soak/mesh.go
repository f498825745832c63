package soak

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/internal/pgproc"
)

// MCPTool is the effect tool of the mesh StartMesh starts, as plans call it.
const MCPTool = "fx__effect"

// StartMesh builds the binaries (meshproc.Build) and the MCP test server and starts
// `curfew up` in dir (emptied first): every service with --pprof, toolrunner with the
// test server as tool source "fx" recording its calls to the returned file, and
// admission sized for concurrency runs in flight (the built-in pools admit 10 at once: a
// soak measures the mesh, not its shedding). What the processes keep of ended runs is
// bounded short (--retention 5s, the orchestrator's --max-runs 4 × concurrency), so that
// the heap after one load and after the next compare: with the defaults (15 minutes,
// 10,000 runs) a few minutes' loads only fill those caches. Stop the mesh when done.
//
// With a store DSN the services share that store (PostgreSQL: RestartStore restarts a
// pgproc server under the load); without, curfew up's SQLite file in dir.
func StartMesh(ctx context.Context, dir string, concurrency int, storeDSN string, stderr io.Writer) (*meshproc.Mesh, string, error) {
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, "", err
	}
	_ = os.RemoveAll(dir)
	if err := os.MkdirAll(dir, 0o755); err != nil { //nolint:gosec // the mesh's data directory
		return nil, "", err
	}
	mcp, err := buildMCPTest(ctx, dir)
	if err != nil {
		return nil, "", err
	}
	record := filepath.Join(dir, "mcp-calls.jsonl")
	tools := filepath.Join(dir, "tools.json")
	if err := os.WriteFile(tools, fmt.Appendf(nil, `{"sources": [{"name": "fx", "kind": "mcp_stdio", "command": %q,
	  "args": ["--record", %q], "side_effects": "irreversible"}]}`, mcp, record), 0o600); err != nil {
		return nil, "", err
	}
	admission := filepath.Join(dir, "admission.json")
	if err := os.WriteFile(admission, fmt.Appendf(nil, `{"pools": [{"name": "soak", "max_in_flight": %d, "max_queue": %d, "max_queue_age": "30s"}]}`,
		concurrency+concurrency/2, max(concurrency, 16)), 0o600); err != nil {
		return nil, "", err
	}
	env := []string{"CURFEW_PPROF=true", "CURFEW_RETENTION=5s", fmt.Sprintf("CURFEW_MAX_RUNS=%d", 4*max(concurrency, 16))}
	args := []string{"--tools-config", tools, "--admission-config", admission}
	if storeDSN != "" {
		args = append(args, "--store", storeDSN)
	}
	m, err := meshproc.Start(ctx, dir, meshproc.Options{Env: env, Args: args, Stderr: stderr})
	return m, record, err
}

// buildMCPTest builds the MCP test server (internal/mcptest) into dir.
func buildMCPTest(ctx context.Context, dir string) (string, error) {
	repo, err := meshproc.Repo()
	if err != nil {
		return "", err
	}
	mcp := filepath.Join(dir, "curfew-mcptest")
	build := exec.CommandContext(ctx, "go", "build", "-o", mcp, "./internal/mcptest/cmd/curfew-mcptest") //nolint:gosec // this repository's test server, into the mesh's directory
	build.Dir = repo
	if b, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building curfew-mcptest: %w\n%s", err, b)
	}
	return mcp, nil
}

// Processes are the mesh's service processes, to sample.
func Processes(m *meshproc.Mesh) []Process {
	var ps []Process
	for _, n := range []string{"orchestrator", "toolrunner", "subagent", "modelproxy"} {
		if ep, ok := m.Endpoints.Services[n]; ok {
			ps = append(ps, Process{Name: n, Admin: ep.AdminAddr})
		}
	}
	return ps
}

// WaitForTool runs a one-call plan of tool until it succeeds: toolrunner lists a source's
// tools in the background after its start.
func WaitForTool(ctx context.Context, orch orchestratorv1.OrchestratorServiceClient, tool string) error {
	task := fmt.Sprintf(`{"steps": [{"tools": [{"name": %q, "idempotency_key": "soak-probe-%d"}]}, {"answer_tokens": 1}]}`, tool, time.Now().UnixNano())
	var last string
	for end := time.Now().Add(time.Minute); time.Now().Before(end); time.Sleep(200 * time.Millisecond) {
		st, err := orch.Run(ctx, &orchestratorv1.RunRequest{Task: task})
		if err != nil {
			return err
		}
		for {
			ev, err := st.Recv()
			if err != nil {
				last = err.Error()
				break
			}
			if f := ev.GetFinished(); f != nil {
				if f.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
					return nil
				}
				last = f.GetStatus().String() + " " + f.GetErrorMessage()
				break
			}
		}
	}
	return errors.New("the MCP tool " + tool + " never answered: " + last)
}

// KillOrder is the order Kills kills the services in.
var KillOrder = []string{"modelproxy", "toolrunner", "subagent", "orchestrator"}

// Kills are faults that SIGKILL one service of the mesh each, in KillOrder, spread evenly
// over a load of duration: `curfew up` is to restart each (docs/cli.md, --max-restarts)
// while the load goes on. The pid is read from endpoints.json when the kill comes.
func Kills(m *meshproc.Mesh, duration time.Duration) []Fault {
	var fs []Fault
	for i, svc := range KillOrder {
		fs = append(fs, Fault{At: duration * time.Duration(i+1) / time.Duration(len(KillOrder)+1), Name: "SIGKILL " + svc,
			Do: func(context.Context) error {
				now, err := ReadState(m.Dir)
				if err != nil {
					return err
				}
				pid := now.PIDs[svc]
				if pid <= 0 {
					return fmt.Errorf("%s has no pid in endpoints.json", svc)
				}
				return syscall.Kill(pid, syscall.SIGKILL)
			}})
	}
	return fs
}

// State is what `curfew up` says of its services: each one's pid and how often it
// restarted one (endpoints.json).
type State struct {
	PIDs     map[string]int
	Restarts map[string]int
}

// ReadState reads the state of the mesh `curfew up` serves from dir.
func ReadState(dir string) (State, error) {
	var e struct {
		Services map[string]struct {
			PID int `json:"pid"`
		} `json:"services"`
		Restarts map[string]int `json:"restarts"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "endpoints.json")) //nolint:gosec // the mesh's data directory
	if err != nil {
		return State{}, err
	}
	if err := json.Unmarshal(b, &e); err != nil {
		return State{}, fmt.Errorf("%s/endpoints.json: %w", dir, err)
	}
	st := State{PIDs: map[string]int{}, Restarts: map[string]int{}}
	for n, svc := range e.Services {
		st.PIDs[n] = svc.PID
	}
	for n, r := range e.Restarts {
		st.Restarts[n] = r
	}
	return st, nil
}

// MeshUp checks, after a load with Kills, that `curfew up` restarted every service it
// killed since before: endpoints.json counts more restarts and names a new, live pid;
// and that every service serves (/readyz).
func MeshUp(ctx context.Context, m *meshproc.Mesh, before State, killed []string) []Check {
	var out []Check
	now, err := ReadState(m.Dir)
	if err != nil {
		return []Check{{Name: "mesh up after the kills", Detail: err.Error()}}
	}
	for _, svc := range killed {
		pid, old := now.PIDs[svc], before.PIDs[svc]
		alive := pid > 0 && syscall.Kill(pid, 0) == nil
		out = append(out, Check{Name: "restarted by curfew up: " + svc, OK: now.Restarts[svc] > before.Restarts[svc] && pid != old && alive,
			Detail: fmt.Sprintf("restarts %d -> %d, pid %d -> %d, running %v", before.Restarts[svc], now.Restarts[svc], old, pid, alive)})
	}
	c := &http.Client{Timeout: 2 * time.Second}
	for _, p := range Processes(m) { // restarted on the same addresses
		ok := false
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.Admin+"/readyz", nil)
		if err == nil {
			if resp, err := c.Do(req); err == nil {
				ok = resp.StatusCode == http.StatusOK
				_ = resp.Body.Close()
			}
		}
		out = append(out, Check{Name: "serving after the load: " + p.Name, OK: ok, Detail: "/readyz on " + p.Admin})
	}
	return out
}

// StoreDown is how long RestartStore keeps the store down.
const StoreDown = 3 * time.Second

// RestartStore is a fault that stops the mesh's PostgreSQL at once (its connections cut)
// at instant at, and starts it again StoreDown later.
func RestartStore(pg *pgproc.Server, at time.Duration) Fault {
	return Fault{At: at, Name: "PostgreSQL restarted", Do: func(ctx context.Context) error {
		if err := pg.Stop(); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
		case <-time.After(StoreDown):
		}
		return pg.Up(context.WithoutCancel(ctx))
	}}
}

// LedgerGap checks, for every modelproxy process running now, that the durable ledger
// at dsn holds every token the process says it emitted: the output and orphan entries
// whose key carries its writer mark (curfew_modelproxy_ledger_writer_info) sum to its
// curfew_model_tokens_total (every series). So the parts it appended while the store was
// down were kept and appended once the store came back, and none twice. A process killed
// during the soak took its counter with it: the entries of writers not running now are
// reported beside the check, not checked. It waits up to 30 s for the last parts.
func LedgerGap(ctx context.Context, dsn string, modelproxies ...Process) Check {
	const name = "no gap in the ledger"
	c := &http.Client{Timeout: 2 * time.Second}
	var (
		gaps        []string
		live, total int64
		err         error
	)
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		gaps, live, total, err = ledgerGaps(ctx, c, dsn, modelproxies)
		if (err == nil && len(gaps) == 0) || time.Now().After(end) || ctx.Err() != nil {
			break
		}
	}
	if err != nil {
		return Check{Name: name, Detail: err.Error()}
	}
	if len(gaps) > 0 {
		return Check{Name: name, Detail: strings.Join(gaps, "; ")}
	}
	return Check{Name: name, OK: true, Detail: fmt.Sprintf("for each of the %d modelproxy processes running now, the ledger holds exactly the output tokens it emitted (%d in all); %d more are from processes killed before the end",
		len(modelproxies), live, total-live)}
}

// ledgerGaps compares each process's counter with its ledger entries once, and returns
// the mismatches, the ledger's output tokens of these processes and of every writer.
func ledgerGaps(ctx context.Context, c *http.Client, dsn string, modelproxies []Process) (gaps []string, live, total int64, err error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, 0, 0, err
	}
	defer func() { _ = conn.Close(ctx) }()
	for _, mp := range modelproxies {
		mfs, err := scrape(ctx, c, "http://"+mp.Admin+"/metrics")
		if err != nil {
			return nil, 0, 0, fmt.Errorf("%s: %w", mp.Name, err)
		}
		writer := ""
		for _, m := range mfs["curfew_modelproxy_ledger_writer_info"].GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "writer" {
					writer = l.GetValue()
				}
			}
		}
		if writer == "" {
			return nil, 0, 0, fmt.Errorf("%s exports no curfew_modelproxy_ledger_writer_info", mp.Name)
		}
		var emitted float64
		for _, m := range mfs["curfew_model_tokens_total"].GetMetric() {
			emitted += m.GetCounter().GetValue()
		}
		var ledger int64
		if err := conn.QueryRow(ctx, `SELECT COALESCE(SUM(tokens), 0) FROM token_ledger WHERE kind <> 'prompt' AND entry_key LIKE '%/' || $1 || '.%'`, writer).Scan(&ledger); err != nil {
			return nil, 0, 0, err
		}
		live += ledger
		if float64(ledger) != emitted {
			gaps = append(gaps, fmt.Sprintf("%s (writer %s) emitted %.0f output tokens, the ledger holds %d of them", mp.Name, writer, emitted, ledger))
		}
	}
	err = conn.QueryRow(ctx, `SELECT COALESCE(SUM(tokens), 0) FROM token_ledger WHERE kind <> 'prompt'`).Scan(&total)
	return gaps, live, total, err
}

// scrape reads a /metrics page.
func scrape(ctx context.Context, c *http.Client, url string) (map[string]*dto.MetricFamily, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(resp.Body)
}
