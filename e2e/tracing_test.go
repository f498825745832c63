package e2e

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// The four services export their spans over OTLP to a real OpenTelemetry Collector on
// loopback (scripts/otelcol.sh builds it; CURFEW_OTELCOL names it). A run with a subagent
// and a tool that fails its first attempt is one trace across all four processes, with one
// client span per attempt of the retried tool carrying curfew.attempt 1 and 2 and one
// retry-id; a run the client disconnects from is one trace too, and its cancelled nodes'
// spans carry the cause. The spans are read after the mesh stopped: what a graceful stop
// flushes is what the test sees.
//
// Not parallel: it starts a mesh and a collector of its own, before the package's
// parallel tests are released.
func TestTracingOneTracePerRun(t *testing.T) {
	col := startCollector(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	m, err := meshproc.Start(ctx, t.TempDir(), meshproc.Options{Env: []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + col.addr,
		"OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
		"OTEL_TRACES_EXPORTER=otlp",
		"OTEL_BSP_SCHEDULE_DELAY=200",
	}})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	defer func() {
		if !stopped {
			_ = m.Stop()
		}
	}()
	c, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}

	// A retried tool and a subagent that calls modelproxy and toolrunner itself.
	const okPlan = `{"tokens_per_second": 1000, "steps": [
	  {"think_tokens": 1, "tools": [
	    {"name": "fail", "args": {"times": 1}},
	    {"name": "spawn_subagent", "args": {"plan": {"tokens_per_second": 1000, "steps": [
	      {"think_tokens": 1, "tools": [{"name": "sleep", "args": {"ms": 1}}]},
	      {"answer_tokens": 1}]}}}]},
	  {"answer_tokens": 1}]}`
	res, _ := runPlan(ctx, c, okPlan, 30*time.Second, 0, false)
	if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run: %v\n%s", res.err, dump(res.finished))
	}
	okRun := res.started.GetRunId()

	// A run whose client disconnects while its tool sleeps.
	cancelRun := disconnectDuringTool(ctx, t, c, `{"tokens_per_second": 1000, "steps": [
	  {"think_tokens": 1, "tools": [{"name": "sleep", "args": {"ms": 20000}}]},
	  {"answer_tokens": 1}]}`)
	r := summary(ctx, t, c, cancelRun)
	if r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("cancelled run's cause: %s\n%s", r.GetCause(), dump(r))
	}

	stopped = true
	if err := m.Stop(); err != nil {
		t.Fatalf("mesh did not stop cleanly: %v", err)
	}
	spans := col.stop(t)
	t.Logf("the collector received %d spans", len(spans))

	t.Run("retried run", func(t *testing.T) {
		trace := oneTrace(t, spans, okRun)
		if testing.Verbose() {
			for _, s := range trace {
				t.Logf("%-12s %-6s %-55s %s parent=%s %v", s.service, s.kind, s.name, s.id, s.parent, s.attrs)
			}
		}
		services := map[string]bool{}
		for _, s := range trace {
			services[s.service] = true
		}
		for _, svc := range []string{"orchestrator", "toolrunner", "subagent", "modelproxy"} {
			if !services[svc] {
				t.Errorf("no span of %s in the run's trace (services: %v)", svc, services)
			}
		}
		run := spanNamed(t, trace, "orchestrator", "run", okRun)
		if run.attrs["curfew.node_status"] != "succeeded" || run.attrs["curfew.node_id"] != "root" {
			t.Errorf("run span: %v", run.attrs)
		}
		// The spans of every call the run made descend from the run span.
		byID := map[string]span{}
		for _, s := range trace {
			byID[s.id] = s
		}
		for _, s := range trace {
			if s.attrs["curfew.run_id"] != okRun || s.id == run.id {
				continue
			}
			if !descends(byID, s, run.id) {
				t.Errorf("span %s (%s, %s) does not descend from the run span", s.name, s.service, s.attrs["curfew.node_id"])
			}
		}
		// The tool that failed once: one client span per attempt at the orchestrator, and one
		// server span per attempt at toolrunner, numbered 1 and 2, with one retry-id.
		for _, side := range []struct{ service, kind string }{{"orchestrator", "Client"}, {"toolrunner", "Server"}} {
			attempts := map[string][]span{}
			for _, s := range trace {
				if s.service == side.service && s.kind == side.kind && strings.HasSuffix(s.name, "ToolRunnerService/Execute") {
					attempts[s.attrs["curfew.node_id"]] = append(attempts[s.attrs["curfew.node_id"]], s)
				}
			}
			retried := attempts["root/s0.t0"]
			sort.Slice(retried, func(i, j int) bool { return retried[i].attrs["curfew.attempt"] < retried[j].attrs["curfew.attempt"] })
			if len(retried) != 2 {
				t.Fatalf("%s: %d %s spans of the failing tool root/s0.t0, want 2 (spans by node: %v)", side.service, len(retried), side.kind, keys(attempts))
			}
			a1, a2 := retried[0], retried[1]
			if a1.attrs["curfew.attempt"] != "1" || a2.attrs["curfew.attempt"] != "2" {
				t.Errorf("%s: attempts %q and %q, want 1 and 2", side.service, a1.attrs["curfew.attempt"], a2.attrs["curfew.attempt"])
			}
			if id := a1.attrs["curfew.retry_id"]; id == "" || id != a2.attrs["curfew.retry_id"] {
				t.Errorf("%s: retry ids %q and %q, want one non-empty id", side.service, id, a2.attrs["curfew.retry_id"])
			}
			if a1.status != "Error" || a2.status == "Error" {
				t.Errorf("%s: status of attempt 1 %s, of attempt 2 %s; want the first to fail and the second not", side.service, a1.status, a2.status)
			}
			if a1.id == a2.id {
				t.Errorf("%s: both attempts are one span", side.service)
			}
		}
		// Model calls record their tokens.
		models := 0
		for _, s := range trace {
			if s.service == "modelproxy" && s.kind == "Server" && strings.HasSuffix(s.name, "/Generate") {
				models++
				if n, err := strconv.Atoi(s.attrs["curfew.tokens"]); err != nil || n < 1 {
					t.Errorf("model span of %s: curfew.tokens %q", s.attrs["curfew.node_id"], s.attrs["curfew.tokens"])
				}
			}
		}
		if models < 4 { // root/m0, root/m1, and the subagent's two
			t.Errorf("%d model spans, want 4", models)
		}
	})

	t.Run("cancelled run", func(t *testing.T) {
		trace := oneTrace(t, spans, cancelRun)
		run := spanNamed(t, trace, "orchestrator", "run", cancelRun)
		if run.attrs["curfew.cancel_cause"] != "client_disconnect" || run.attrs["curfew.node_status"] != "cancelled" {
			t.Errorf("run span of the cancelled run: %v", run.attrs)
		}
		// The orchestrator knows the cause of the tool call it cancelled; the executors know
		// it when the one-hop broadcast reached them before the RST_STREAM, and never know
		// another one.
		var client, server int
		for _, s := range trace {
			if s.attrs["curfew.node_id"] != "root/s0.t0" || !strings.HasSuffix(s.name, "ToolRunnerService/Execute") {
				continue
			}
			switch s.kind {
			case "Client":
				client++
				if s.attrs["curfew.cancel_cause"] != "client_disconnect" {
					t.Errorf("client span of the cancelled tool: %v", s.attrs)
				}
			case "Server":
				server++
				if c, ok := s.attrs["curfew.cancel_cause"]; ok && c != "client_disconnect" {
					t.Errorf("server span of the cancelled tool: cause %q", c)
				}
				if s.attrs["curfew.node_status"] != "cancelled" {
					t.Errorf("server span of the cancelled tool: %v", s.attrs)
				}
			}
		}
		if client != 1 || server != 1 {
			t.Errorf("cancelled tool: %d client and %d server spans, want 1 and 1", client, server)
		}
		for _, s := range trace {
			if c, ok := s.attrs["curfew.cancel_cause"]; ok && c != "client_disconnect" {
				t.Errorf("span %s (%s, %s) carries cause %q", s.name, s.service, s.attrs["curfew.node_id"], c)
			}
		}
	})
}

// disconnectDuringTool runs plan and cancels the call once the first tool node is running,
// returning the run id.
func disconnectDuringTool(ctx context.Context, t *testing.T, c orchestratorv1.OrchestratorServiceClient, plan string) string {
	t.Helper()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := c.Run(cctx, &orchestratorv1.RunRequest{Task: plan})
	if err != nil {
		t.Fatal(err)
	}
	var id string
	for {
		ev, err := st.Recv()
		if err != nil {
			t.Fatalf("run ended before its tool started: %v", err)
		}
		switch e := ev.GetEvent().(type) {
		case *orchestratorv1.RunResponse_Started:
			id = e.Started.GetRunId()
		case *orchestratorv1.RunResponse_Node:
			if e.Node.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL && e.Node.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
				// The orchestrator emits the node as it sends the call; give the call time to
				// reach toolrunner, so that there is a server span to cancel.
				time.Sleep(300 * time.Millisecond)
				cancel()
				return id
			}
		}
	}
}

// span is one span as the collector's debug exporter printed it.
type span struct {
	service, traceID, parent, id, name, kind, status string
	attrs                                            map[string]string
}

// oneTrace returns every span of the trace of run (the trace of the spans that carry its
// run id), failing unless all of them are in one trace.
func oneTrace(t *testing.T, spans []span, run string) []span {
	t.Helper()
	ids := map[string]int{}
	for _, s := range spans {
		if s.attrs["curfew.run_id"] == run {
			ids[s.traceID]++
		}
	}
	if len(ids) != 1 {
		t.Fatalf("spans of run %s are in %d traces, want 1: %v", run, len(ids), ids)
	}
	var out []span
	for id := range ids {
		for _, s := range spans {
			if s.traceID == id {
				out = append(out, s)
			}
		}
	}
	return out
}

func spanNamed(t *testing.T, spans []span, service, name, run string) span {
	t.Helper()
	for _, s := range spans {
		if s.service == service && s.name == name && s.attrs["curfew.run_id"] == run {
			return s
		}
	}
	t.Fatalf("no %s span %q of run %s", service, name, run)
	return span{}
}

// descends reports whether s has ancestor among its parents in byID.
func descends(byID map[string]span, s span, ancestor string) bool {
	for i := 0; i < 100 && s.parent != ""; i++ {
		if s.parent == ancestor {
			return true
		}
		p, ok := byID[s.parent]
		if !ok {
			return false
		}
		s = p
	}
	return false
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// collector is an OpenTelemetry Collector receiving OTLP/gRPC on loopback and writing what
// it receives, in the debug exporter's detailed text, to a file.
type collector struct {
	cmd  *exec.Cmd
	addr string
	out  string
	done chan struct{} // closed when the process has exited, with err
	err  error
}

// startCollector starts the collector of CURFEW_OTELCOL. Without it the test is skipped,
// and fails under CI=true.
func startCollector(t *testing.T) *collector {
	t.Helper()
	bin := os.Getenv("CURFEW_OTELCOL")
	if bin == "" {
		meshproc.Missing(t, "CURFEW_OTELCOL is not set; scripts/test.sh sets it (scripts/otelcol.sh builds the collector)")
	}
	dir := t.TempDir()
	var lastErr error
	for range 5 { // the port is picked free, then bound by the collector: retry a lost race
		c := &collector{addr: freeAddr(t), out: filepath.Join(dir, "spans.txt"), done: make(chan struct{})}
		cfg := filepath.Join(dir, "config.yaml")
		if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`receivers:
  otlp:
    protocols:
      grpc:
        endpoint: %s
exporters:
  debug:
    verbosity: detailed
    use_internal_logger: false
    output_paths: [%q]
    sampling_initial: 1000000
    sampling_thereafter: 1
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [debug]
`, c.addr, c.out)), 0o600); err != nil {
			t.Fatal(err)
		}
		c.cmd = exec.Command(bin, "--config", cfg) //nolint:noctx // stopped with SIGTERM by stop, so that it flushes
		logf, err := os.Create(filepath.Join(dir, "collector.log"))
		if err != nil {
			t.Fatal(err)
		}
		c.cmd.Stdout, c.cmd.Stderr = logf, logf
		c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := c.cmd.Start(); err != nil {
			_ = logf.Close()
			t.Fatal(err)
		}
		go func() { c.err = c.cmd.Wait(); _ = logf.Close(); close(c.done) }()
		if lastErr = c.ready(); lastErr == nil {
			t.Cleanup(func() {
				select {
				case <-c.done:
				default:
					_ = c.cmd.Process.Kill()
					<-c.done
				}
			})
			return c
		}
		_ = c.cmd.Process.Kill()
		<-c.done
	}
	log, _ := os.ReadFile(filepath.Join(dir, "collector.log"))
	t.Fatalf("collector did not start: %v\n%s", lastErr, log)
	return nil
}

// ready waits until the collector accepts connections.
func (c *collector) ready() error {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-c.done:
			return fmt.Errorf("collector exited: %w", c.err)
		default:
		}
		d := net.Dialer{Timeout: time.Second}
		if conn, err := d.DialContext(context.Background(), "tcp", c.addr); err == nil {
			_ = conn.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("collector not listening within 30s")
}

// stop stops the collector gracefully (it exports what it holds) and returns every span
// it received.
func (c *collector) stop(t *testing.T) []span {
	t.Helper()
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
		t.Fatal("collector did not stop within 30s")
	}
	f, err := os.Open(c.out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	spans, err := parseSpans(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(spans) == 0 {
		t.Fatal("the collector received no spans")
	}
	return spans
}

// parseSpans reads the debug exporter's detailed text (collector
// exporter/debugexporter/internal/otlptext).
func parseSpans(r io.Reader) ([]span, error) {
	var (
		out      []span
		cur      *span
		service  string
		inRes    bool // in "Resource attributes:"
		inAttrs  bool // in a span's "Attributes:"
		flushCur = func() {
			if cur != nil {
				out = append(out, *cur)
				cur = nil
			}
		}
	)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		trimmed := strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(line, "ResourceSpans #"):
			flushCur()
			service, inRes, inAttrs = "", false, false
		case line == "Resource attributes:":
			inRes, inAttrs = true, false
		case strings.HasPrefix(line, "Span #"):
			flushCur()
			cur = &span{service: service, attrs: map[string]string{}}
			inRes, inAttrs = false, false
		case line == "Attributes:" && cur != nil:
			inAttrs = true
		case strings.HasPrefix(line, "     -> ") && (inRes || inAttrs):
			k, v, ok := strings.Cut(strings.TrimPrefix(line, "     -> "), ": ")
			if !ok {
				continue
			}
			if i := strings.IndexByte(v, '('); i >= 0 && strings.HasSuffix(v, ")") {
				v = v[i+1 : len(v)-1]
			}
			if inRes {
				if k == "service.name" {
					service = v
				}
			} else {
				cur.attrs[k] = v
			}
		case strings.HasPrefix(line, "    ") && cur != nil && !inAttrs:
			k, v, ok := strings.Cut(trimmed, ":")
			if !ok {
				continue
			}
			k, v = strings.TrimSpace(k), strings.TrimSpace(v)
			switch k {
			case "Trace ID":
				cur.traceID = v
			case "Parent ID":
				cur.parent = v
			case "ID":
				cur.id = v
			case "Name":
				cur.name = v
			case "Kind":
				cur.kind = v
			case "Status code":
				cur.status = v
			}
		default:
			if !strings.HasPrefix(line, "     -> ") {
				inRes, inAttrs = false, false
			}
		}
	}
	flushCur()
	return out, sc.Err()
}

// freeAddr returns a loopback address with a port that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	var lc net.ListenConfig
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}
