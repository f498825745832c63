package bench

import (
	"bufio"
	"bytes"
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
	"sync"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
)

// The real-model benchmarks of issue 21: a real mesh under `curfew up` (mTLS, the
// SQLite store under its data directory) whose modelproxy calls an OpenAI-compatible
// model server, the openaitest server (services/modelproxy/internal/provider/openaitest)
// running as a process of its own. The floor of each benchmark is the same server called
// directly over HTTP by this process.

// benchModel is the alias the providers file gives the model server; benchTask is every
// request's user message.
const (
	benchModel = "bench"
	benchTask  = "Say hello."
)

var (
	modelBinOnce sync.Once
	modelBin     string
	modelBinErr  error
	modelBinTemp string // a directory made here, removed by cleanupModelBin
)

// modelServerBin returns the openaitest command, from CURFEW_BIN_DIR when it holds one,
// else built once per process.
func modelServerBin(tb testing.TB) string {
	tb.Helper()
	modelBinOnce.Do(func() {
		if d := os.Getenv("CURFEW_BIN_DIR"); d != "" && fileOK(filepath.Join(d, "openaitest")) {
			modelBin = filepath.Join(d, "openaitest")
			return
		}
		if _, err := exec.LookPath("go"); err != nil {
			modelBinErr = errMissingGo
			return
		}
		repo, err := meshproc.Repo()
		if err != nil {
			modelBinErr = err
			return
		}
		if modelBinTemp, modelBinErr = os.MkdirTemp("", "curfew-openaitest-"); modelBinErr != nil {
			return
		}
		modelBin = filepath.Join(modelBinTemp, "openaitest")
		cmd := exec.Command("go", "build", "-o", modelBin, "./services/modelproxy/internal/provider/openaitest/cmd/openaitest") //nolint:noctx,gosec // a bounded build of this repository's package
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			modelBinErr = fmt.Errorf("go build openaitest: %w\n%s", err, out)
		}
	})
	if errors.Is(modelBinErr, errMissingGo) {
		meshproc.Missing(tb, "the real-model benchmarks build openaitest: %v", modelBinErr)
	}
	if modelBinErr != nil {
		tb.Fatal(modelBinErr)
	}
	return modelBin
}

// cleanupModelBin removes the openaitest binary modelServerBin built (called by TestMain).
func cleanupModelBin() {
	if modelBinTemp != "" {
		_ = os.RemoveAll(modelBinTemp)
	}
}

// modelServer is an openaitest process.
type modelServer struct {
	url string       // the API base, ending in /v1
	hc  *http.Client // for the control API
}

// startModelServer starts an openaitest process, stopped when tb ends.
func startModelServer(tb testing.TB) *modelServer {
	tb.Helper()
	cmd := exec.Command(modelServerBin(tb), "-addr", "127.0.0.1:0") //nolint:noctx,gosec // stopped by the cleanup below
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		tb.Fatal("openaitest printed no URL: ", err)
	}
	go func() { _, _ = io.Copy(io.Discard, out) }()
	return &modelServer{url: strings.TrimSpace(line), hc: &http.Client{Timeout: time.Minute}}
}

func (s *modelServer) control() string { return strings.TrimSuffix(s.url, "/v1") + "/_openaitest" }

// enqueue scripts the next replies (openaitest.Reply as JSON), one per request.
func (s *modelServer) enqueue(replies []map[string]any) error {
	b, err := json.Marshal(replies)
	if err != nil {
		return err
	}
	resp, err := s.hc.Post(s.control()+"/replies", "application/json", bytes.NewReader(b))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		body, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("enqueue: %s: %s", resp.Status, body)
	}
	return nil
}

// modelCall is what the control API reports of one request (openaitest.Call).
type modelCall struct {
	N       int
	Request struct{ Body []byte }
	// Start is when the request arrived, Headers when the response headers were
	// written, End when the handler returned.
	Start, Headers, End time.Time
	Chunks              int
	// ClientGone and GoneAt: the request's context ended before the reply's end, and when
	// (on the server's clock, the machine's wall clock).
	ClientGone bool
	GoneAt     time.Time
}

// calls returns every call so far.
func (s *modelServer) calls() ([]modelCall, error) {
	resp, err := s.hc.Get(s.control() + "/calls")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var cs []modelCall
	return cs, json.NewDecoder(resp.Body).Decode(&cs)
}

// modelMesh is a mesh whose modelproxy serves benchModel from a model server, and the
// key of a tenant for the front door.
type modelMesh struct {
	*meshproc.Mesh
	key     string // a tenant's API key (the front door's bearer token)
	openai  string // the front door's base URL, ending in /v1
	model   *modelServer
	orch    orchestratorv1.OrchestratorServiceClient
	mp      meshv1.NodeReportServiceClient
	door    *http.Client // keep-alive connections to the front door
	direct  *http.Client // keep-alive connections to the model server (the floor)
	procsOf procs
}

// startModelMesh starts a model server and a mesh in front of it. The response cache is
// off (every call must reach the server) and admission has room and no rate limit for
// every stream the benchmarks open.
func startModelMesh(b *testing.B) *modelMesh {
	b.Helper()
	ms := startModelServer(b)
	providers := fmt.Sprintf(`{"providers": [{"name": "up", "base_url": %q, "models": ["m"]}],
  "models": {%q: {"chain": ["up/m"]}}, "cache": {"off": true}}`, ms.url, benchModel)
	cfg := filepath.Join(b.TempDir(), "providers.json")
	if err := os.WriteFile(cfg, []byte(providers), 0o600); err != nil {
		b.Fatal(err)
	}
	m := startMesh(b, "CURFEW_PROVIDERS_CONFIG="+cfg, "CURFEW_ADMISSION_CONFIG="+roomFor(b, 512))
	mm := &modelMesh{Mesh: m, model: ms}
	addr := m.Endpoints.Services["orchestrator"].OpenAIAddr
	if addr == "" {
		b.Fatal("curfew up wrote no openai_addr for the orchestrator")
	}
	mm.openai = "http://" + addr + "/v1"
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, filepath.Join(m.Bin, "curfew"), "tenant", "create", "bench", "--data-dir", m.Dir, "--json").Output() //nolint:gosec // the curfew this package built
	if err != nil {
		b.Fatal("curfew tenant create: ", err)
	}
	var k struct{ Key string }
	if err := json.Unmarshal(out, &k); err != nil || k.Key == "" {
		b.Fatalf("curfew tenant create printed %s (%v)", out, err)
	}
	mm.key = k.Key
	if mm.orch, err = m.Orchestrator(); err != nil {
		b.Fatal(err)
	}
	if mm.mp, err = m.Report("modelproxy"); err != nil {
		b.Fatal(err)
	}
	// One transport per side, each keeping enough idle connections for every stream.
	newClient := func() *http.Client {
		tr := &http.Transport{MaxIdleConnsPerHost: 256, IdleConnTimeout: time.Minute}
		b.Cleanup(tr.CloseIdleConnections)
		return &http.Client{Transport: tr}
	}
	mm.door, mm.direct = newClient(), newClient()
	for i, name := range serviceNames {
		mm.procsOf.pids[i] = m.Endpoints.Services[name].PID
		mm.procsOf.admins[i] = m.Endpoints.Services[name].AdminAddr
	}
	return mm
}

// doorBody is a streamed completion request to the front door.
func doorBody() []byte {
	b, _ := json.Marshal(map[string]any{"model": benchModel, "stream": true,
		"messages": []map[string]string{{"role": "user", "content": benchTask}}})
	return b
}

// streamRequest is a POST of body to base's chat completions; the front door's carries
// the tenant's key and an explicit deadline.
func (mm *modelMesh) streamRequest(ctx context.Context, door bool, body []byte) (*http.Request, *http.Client) {
	base, hc := mm.model.url, mm.direct
	if door {
		base, hc = mm.openai, mm.door
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/chat/completions", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if door {
		req.Header.Set("Authorization", "Bearer "+mm.key)
		req.Header.Set("X-Curfew-Timeout", "2m")
	}
	return req, hc
}

// sseChunk is the part of a chat.completion.chunk the benchmarks read.
type sseChunk struct {
	ID      string `json:"id"`
	Choices []struct {
		Delta struct {
			Content string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
}

// firstContent reads SSE events until the first chunk with content, and returns it.
func firstContent(r *bufio.Reader) (sseChunk, error) {
	for {
		line, err := r.ReadSlice('\n')
		if err != nil {
			return sseChunk{}, err
		}
		data, ok := bytes.CutPrefix(line, []byte("data: "))
		if !ok {
			continue
		}
		data = bytes.TrimSpace(data)
		if string(data) == "[DONE]" {
			return sseChunk{}, errors.New("[DONE] before any content")
		}
		var c sseChunk
		if err := json.Unmarshal(data, &c); err != nil {
			return sseChunk{}, fmt.Errorf("chunk %s: %w", data, err)
		}
		if len(c.Choices) > 0 && c.Choices[0].Delta.Content != "" {
			return c, nil
		}
	}
}

// firstDeltaHTTP posts body and returns the time to the first chunk with content, then
// reads the stream to its end.
func (mm *modelMesh) firstDeltaHTTP(ctx context.Context, door bool, body []byte) (deltaSample, error) {
	var s deltaSample
	req, hc := mm.streamRequest(ctx, door, body)
	s.t0 = time.Now()
	resp, err := hc.Do(req)
	if err != nil {
		return s, err
	}
	defer resp.Body.Close()
	s.started = time.Now()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return s, fmt.Errorf("%s: %s", resp.Status, b)
	}
	br := bufio.NewReader(resp.Body)
	c, err := firstContent(br)
	if err != nil {
		return s, err
	}
	s.first = time.Now()
	if door {
		s.run = c.ID
	}
	_, err = io.Copy(io.Discard, br)
	return s, err
}

// deltaSample is one sample's instants (wall clock; every process is on this machine).
type deltaSample struct {
	run string    // the run's id (curfew's paths)
	t0  time.Time // the call began
	// started is when the response headers arrived (HTTP: the front door writes them
	// once the run has started) or the RunStarted event (Run).
	started time.Time
	// at is the TextDelta's own instant, stamped by the agent loop in the orchestrator
	// (Run only).
	at    time.Time
	first time.Time // the first content arrived
	// upStart and upHeaders are the model server's records of its request: arrival and
	// response headers (filled in after the run from its calls).
	upStart, upHeaders time.Time
}

func (s deltaSample) d() time.Duration { return s.first.Sub(s.t0) }

// firstDeltaRun calls OrchestratorService.Run and returns the time to the first
// TextDelta node event, then reads the stream to its end.
func (mm *modelMesh) firstDeltaRun(ctx context.Context) (deltaSample, error) {
	var s deltaSample
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	s.t0 = time.Now()
	st, err := mm.orch.Run(ctx, &orchestratorv1.RunRequest{Task: benchTask, Model: benchModel})
	if err != nil {
		return s, err
	}
	var fin *orchestratorv1.Run
	for {
		ev, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return s, err
		}
		if s.started.IsZero() && ev.GetStarted() != nil {
			s.started = time.Now()
			s.run = ev.GetStarted().GetRunId()
		}
		if s.first.IsZero() && ev.GetNodeEvent().GetText() != nil {
			s.first = time.Now()
			s.at = ev.GetNodeEvent().GetAt().AsTime()
		}
		if f := ev.GetFinished(); f != nil {
			fin = f
		}
	}
	if s.first.IsZero() {
		return s, fmt.Errorf("run ended without a text delta: %v", fin)
	}
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		return s, fmt.Errorf("run %s ended %v: %s", fin.GetRunId(), fin.GetStatus(), fin.GetErrorMessage())
	}
	return s, nil
}

// upstreamBody makes one streamed completion through the front door and returns the body
// modelproxy sent the model server for it: the floor's request body.
func (mm *modelMesh) upstreamBody(b *testing.B) []byte {
	b.Helper()
	if _, err := mm.firstDeltaHTTP(context.Background(), true, doorBody()); err != nil {
		b.Fatal("front door: ", err)
	}
	calls, err := mm.model.calls()
	if err != nil {
		b.Fatal(err)
	}
	if len(calls) == 0 {
		b.Fatal("the model server saw no request")
	}
	return calls[len(calls)-1].Request.Body
}

// firstDeltaSettle separates two samples, long enough for what a completed run leaves
// behind (modelproxy's batched ledger append waits 20 ms) to be done before the next
// sample, of whichever path, starts.
const firstDeltaSettle = 50 * time.Millisecond

// The paths of BenchmarkFirstDelta, in the order of their columns.
var firstDeltaPaths = []string{"floor", "door", "run"}

// BenchmarkFirstDelta measures the time to the first streamed delta of an answer, over
// the real processes, on three paths to the same model server (openaitest, which sends
// its first content chunk at once: the default reply of four words, no delays):
//
//   - floor: the model server's streaming endpoint called directly over HTTP, with the
//     very body modelproxy sends it (taken from the server's record of a front-door call),
//     until the first SSE chunk with content;
//   - door: POST /v1/chat/completions with "stream": true to the front door (the tenant's
//     API key, a 2m X-Curfew-Timeout), until the first SSE chunk with content;
//   - run: OrchestratorService.Run (as curfew-cli over mTLS), until the first TextDelta
//     node event.
//
// Each iteration takes one sample of each path, in an order that rotates with the
// iteration, reading each stream to its end and pausing firstDeltaSettle after it.
// Metrics: each path's p50 and p99 in µs and, per curfew path, its p50 minus the floor's
// (the target of issue 21: ≤ 2 ms added at the p50).
func BenchmarkFirstDelta(b *testing.B) {
	mm := startModelMesh(b)
	ctx := context.Background()
	load0 := loadAvg()
	floorBody := mm.upstreamBody(b)
	// Warm-up, not recorded: connections, the providers' first calls, the key's first use.
	for range 5 {
		if _, err := mm.firstDeltaHTTP(ctx, true, doorBody()); err != nil {
			b.Fatal("front door: ", err)
		}
		if _, err := mm.firstDeltaRun(ctx); err != nil {
			b.Fatal("run: ", err)
		}
		if _, err := mm.firstDeltaHTTP(ctx, false, floorBody); err != nil {
			b.Fatal("floor: ", err)
		}
	}
	calls0, err := mm.model.calls()
	if err != nil {
		b.Fatal(err)
	}
	var order []int // the path of each sample, in the order the model server saw them
	samples := make([][]deltaSample, len(firstDeltaPaths))
	i := 0
	for b.Loop() {
		for k := range firstDeltaPaths {
			p := (i + k) % len(firstDeltaPaths)
			var s deltaSample
			var err error
			switch firstDeltaPaths[p] {
			case "floor":
				s, err = mm.firstDeltaHTTP(ctx, false, floorBody)
			case "door":
				s, err = mm.firstDeltaHTTP(ctx, true, doorBody())
			case "run":
				s, err = mm.firstDeltaRun(ctx)
			}
			if err != nil {
				b.Fatalf("%s: %v", firstDeltaPaths[p], err)
			}
			samples[p] = append(samples[p], s)
			order = append(order, p)
			time.Sleep(firstDeltaSettle)
		}
		i++
	}
	b.StopTimer()
	// Each sample made exactly one request to the model server, one after the other.
	calls, err := mm.model.calls()
	if err != nil {
		b.Fatal(err)
	}
	if mine := calls[len(calls0):]; len(mine) == len(order) {
		next := make([]int, len(firstDeltaPaths))
		for j, p := range order {
			samples[p][next[p]].upStart, samples[p][next[p]].upHeaders = mine[j].Start, mine[j].Headers
			next[p]++
		}
	} else {
		b.Logf("the model server saw %d requests for %d samples: no breakdown", len(mine), len(order))
	}
	if err := writeDeltaRaw(samples); err != nil {
		b.Log("raw samples: ", err)
	}
	dists := make([]Dist, len(firstDeltaPaths))
	for p := range samples {
		for _, s := range samples[p] {
			dists[p] = append(dists[p], s.d())
		}
	}
	floor := dists[0].Quantile(.5)
	for p, name := range firstDeltaPaths {
		b.ReportMetric(usf(dists[p].Quantile(.5)), name+"-p50-us")
		b.ReportMetric(usf(dists[p].Quantile(.99)), name+"-p99-us")
		if p > 0 {
			b.ReportMetric(usf(dists[p].Quantile(.5)-floor), name+"-added-p50-us")
		}
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\ntime to first streamed delta (µs), %d samples per path, load %s at start, %s at end\n", len(dists[0]), load0, loadAvg())
	fmt.Fprintf(&sb, "| path | p50 | p90 | p99 | max | min | added at p50 |\n|---|---:|---:|---:|---:|---:|---:|\n")
	for p, name := range firstDeltaPaths {
		s := dists[p]
		added := "–"
		if p > 0 {
			added = "+" + us(s.Quantile(.5)-floor)
		}
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s | %s | %s |\n", name, us(s.Quantile(.5)), us(s.Quantile(.9)), us(s.Quantile(.99)), us(s.Max()), us(s.Min()), added)
	}
	// Where the time goes: the p50 of each segment between the instants of a sample.
	seg := func(ss []deltaSample, from, to func(deltaSample) time.Time) string {
		var d Dist
		for _, s := range ss {
			if from(s).IsZero() || to(s).IsZero() {
				return "–"
			}
			d = append(d, to(s).Sub(from(s)))
		}
		return us(d.Quantile(.5))
	}
	t0 := func(s deltaSample) time.Time { return s.t0 }
	started := func(s deltaSample) time.Time { return s.started }
	upStart := func(s deltaSample) time.Time { return s.upStart }
	upHeaders := func(s deltaSample) time.Time { return s.upHeaders }
	at := func(s deltaSample) time.Time { return s.at }
	first := func(s deltaSample) time.Time { return s.first }
	fmt.Fprintf(&sb, "\nsegments, p50 µs: call → started (door: response headers; run: RunStarted), started → the model server has the request, → its headers, → the loop's TextDelta (run), → the client has the content\n")
	fmt.Fprintf(&sb, "| path | call → started | call → request at server | started → request at server | request → headers | headers → TextDelta | TextDelta → client | headers → client |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for p, name := range firstDeltaPaths {
		ss := samples[p]
		startedCol, toUp := "–", "–"
		if p > 0 {
			startedCol, toUp = seg(ss, t0, started), seg(ss, started, upStart)
		}
		atCol, atFirst := "–", "–"
		if name == "run" {
			atCol, atFirst = seg(ss, upHeaders, at), seg(ss, at, first)
		}
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", name, startedCol, seg(ss, t0, upStart), toUp,
			seg(ss, upStart, upHeaders), atCol, atFirst, seg(ss, upHeaders, first))
	}
	addReport(sb.String())
}

// writeDeltaRaw writes every sample's instants as CSV (Unix ns, 0 for none) into
// CURFEW_BENCH_RAW (a directory) when set.
func writeDeltaRaw(samples [][]deltaSample) error {
	dir := os.Getenv("CURFEW_BENCH_RAW")
	if dir == "" {
		return nil
	}
	ns := func(t time.Time) int64 {
		if t.IsZero() {
			return 0
		}
		return t.UnixNano()
	}
	var sb strings.Builder
	sb.WriteString("path,run,t0,started,up_start,up_headers,text_delta_at,first\n")
	for p, name := range firstDeltaPaths {
		for _, s := range samples[p] {
			fmt.Fprintf(&sb, "%s,%s,%d,%d,%d,%d,%d,%d\n", name, s.run, ns(s.t0), ns(s.started), ns(s.upStart), ns(s.upHeaders), ns(s.at), ns(s.first))
		}
	}
	return os.WriteFile(filepath.Join(dir, "first-delta.csv"), []byte(sb.String()), 0o644)
}

func usf(d time.Duration) float64 { return float64(d) / 1e3 }

// loadAvg returns the machine's load averages (1, 5, 15 min).
func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
