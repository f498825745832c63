package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc/metadata"

	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// Settings of the tool benchmarks.
const (
	// A wait call of the cancel benchmark reports progress every toolProgressMS; the
	// caller cancels it toolCancelPause after the first report reached it (the handler
	// runs, and both processes have gone idle again, as when a real caller gives up),
	// well before the second report is due.
	toolProgressMS  = 50
	toolCancelPause = 15 * time.Millisecond
	// toolWaitMS keeps every wait call going far longer than an iteration.
	toolWaitMS = 600_000
	// toolDeadline is each call's deadline; it never fires in a benchmark.
	toolDeadline = 9 * time.Minute
)

// toolsConfig is the tools file of the cancel and call benchmarks: the test server over
// stdio (st, recording into record) and over streamable HTTP at url (ht).
func toolsConfig(mcptestBin, record, url string) string {
	return fmt.Sprintf(`{"sources": [
	  {"name": "st", "kind": "mcp_stdio", "command": %q, "args": ["--record", %q]},
	  {"name": "ht", "kind": "mcp_http", "url": %q}]}`, mcptestBin, record, url)
}

// toolFixture is the processes of the cancel and call benchmarks.
type toolFixture struct {
	tr             *trProc
	bareSt, bareHt *mcp.ClientSession
	recTR, recBare *recordFile   // stdio servers' records: toolrunner's child, the bare client's
	recHTTP        *recordFile   // the HTTP server's, shared by toolrunner and the bare client
	progress       chan struct{} // the bare clients' progress reports
}

func newToolFixture(b *testing.B) *toolFixture {
	_, bin := toolBins(b)
	dir := b.TempDir()
	f := &toolFixture{
		recTR:    &recordFile{path: filepath.Join(dir, "st.jsonl")},
		recBare:  &recordFile{path: filepath.Join(dir, "bare.jsonl")},
		recHTTP:  &recordFile{path: filepath.Join(dir, "http.jsonl")},
		progress: make(chan struct{}, 1),
	}
	url := startMCPHTTP(b, f.recHTTP.path)
	f.tr = startToolrunner(b, toolsConfig(bin, f.recTR.path, url))
	f.bareSt = bareStdio(b, f.recBare.path, f.progress)
	f.bareHt = bareHTTP(b, url, f.progress)
	waitTools(b, f.tr.client, []string{"st__echo", "ht__echo"}, `{"text": "warm"}`)
	for _, cs := range []*mcp.ClientSession{f.bareSt, f.bareHt} {
		if _, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "echo", Arguments: map[string]any{"text": "warm"}}); err != nil {
			b.Fatal(err)
		}
	}
	// The warm-up calls' records.
	for _, r := range []*recordFile{f.recTR, f.recBare, f.recHTTP, f.recHTTP} {
		if _, err := r.next(10 * time.Second); err != nil {
			b.Fatal(err)
		}
	}
	return f
}

// A cancel case: a path (curfew or bare) over a transport (stdio or http).
type toolCase struct {
	name   string
	curfew bool
	http   bool
}

var cancelCases = []toolCase{
	{"stdio/curfew", true, false}, {"stdio/bare", false, false},
	{"http/curfew", true, true}, {"http/bare", false, true},
}

// BenchmarkToolCancel measures the time from a caller's cancel of an MCP tool call to
// the MCP server's handler seeing its context end, for the test server's wait tool over
// stdio and over streamable HTTP on loopback, through curfew and bare:
//
//   - curfew: ToolRunnerService.Execute of st__wait or ht__wait on a toolrunner process
//     (--tools-config; the run and node metadata an agent sends), the caller cancelling
//     its stream (RST_STREAM); toolrunner's MCP source then sends notifications/cancelled;
//   - bare (the floor): a go-sdk client calling wait on the same server binary (stdio: a
//     child of its own; HTTP: the very same server process) and cancelling its ctx.
//
// Each call reports progress every 50 ms; the caller cancels it 15 ms after the first
// report reached it. Each iteration takes one sample of each of the four cases, in an order that rotates
// with the iteration, so that the machine's noise falls on all alike. A sample is the
// server's recorded ctx-done instant (curfew-mcptest --record) minus the caller's
// instant just before cancel(): one wall clock, one machine. Run with
// -benchtime=<iterations>x; nearest-rank percentiles.
func BenchmarkToolCancel(b *testing.B) {
	f := newToolFixture(b)
	d := make([]Dist, len(cancelCases))
	for i := range 3 { // warm-up, not recorded
		for _, c := range cancelCases {
			if _, err := f.cancelOnce(c, fmt.Sprintf("warm-%d", i)); err != nil {
				b.Fatal(err)
			}
		}
	}
	i := 0
	for b.Loop() {
		for k := range cancelCases {
			j := (k + i) % len(cancelCases)
			s, err := f.cancelOnce(cancelCases[j], fmt.Sprintf("bench-cancel-%d", i))
			if err != nil {
				b.Fatal(err)
			}
			d[j] = append(d[j], s)
		}
		i++
	}
	for j, c := range cancelCases {
		unit := strings.ReplaceAll(c.name, "/", "-")
		b.ReportMetric(msf(d[j].Quantile(.5)), unit+"-p50-ms")
		b.ReportMetric(msf(d[j].Quantile(.99)), unit+"-p99-ms")
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "\ntool cancel: caller's cancel → MCP handler's ctx done (ms), %d samples per case\n", len(d[0]))
	sb.WriteString("| transport | path | p50 | p90 | p99 | max | min |\n|---|---|---:|---:|---:|---:|---:|\n")
	for j, c := range cancelCases {
		tr, path, _ := strings.Cut(c.name, "/")
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s | %s | %s |\n", tr, path, ms(d[j].Quantile(.5)), ms(d[j].Quantile(.9)),
			ms(d[j].Quantile(.99)), ms(d[j].Max()), ms(d[j].Min()))
	}
	addReport(sb.String())
}

// cancelOnce starts a wait call by c's path, cancels it toolCancelPause after its first
// progress report and returns the cancel → handler ctx done time.
func (f *toolFixture) cancelOnce(c toolCase, run string) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), toolDeadline)
	defer cancel()
	ended := make(chan error, 1)
	progress := make(chan struct{}, 1)
	rec := f.recTR
	switch {
	case c.curfew:
		name := "st__wait"
		if c.http {
			name, rec = "ht__wait", f.recHTTP
		}
		args := fmt.Sprintf(`{"ms": %d, "progress_ms": %d}`, toolWaitMS, toolProgressMS)
		go func() { ended <- executeProgress(ctx, f.tr.client, run, name, args, progress) }()
	default:
		cs := f.bareSt
		rec = f.recBare
		if c.http {
			cs, rec = f.bareHt, f.recHTTP
		}
		select { // a late report of an earlier call
		case <-f.progress:
		default:
		}
		progress = f.progress
		go func() {
			p := &mcp.CallToolParams{Name: "wait", Arguments: map[string]any{"ms": toolWaitMS, "progress_ms": toolProgressMS}}
			p.SetProgressToken(run)
			_, err := cs.CallTool(ctx, p)
			ended <- err
		}()
	}
	select {
	case <-progress:
	case err := <-ended:
		return 0, fmt.Errorf("%s: the call ended before its first progress report: %w", c.name, err)
	case <-time.After(30 * time.Second):
		return 0, fmt.Errorf("%s: no progress report within 30 s", c.name)
	}
	time.Sleep(toolCancelPause)
	t0 := time.Now()
	cancel()
	r, err := rec.next(10 * time.Second)
	if err != nil {
		return 0, fmt.Errorf("%s: the handler ran but did not return within 10 s of the cancel: %w", c.name, err)
	}
	if err := <-ended; err == nil {
		return 0, fmt.Errorf("%s: the call succeeded after its cancel", c.name)
	}
	if r.Tool != "wait" || r.StartedNS == 0 || r.StartedNS > t0.UnixNano() || r.CtxDoneNS == 0 {
		return 0, fmt.Errorf("%s: record %+v: not this call, or its ctx never ended", c.name, r)
	}
	return time.Duration(r.CtxDoneNS - t0.UnixNano()), nil
}

// callCases are the cases of BenchmarkToolCall.
var callCases = []string{"stdio/curfew", "stdio/bare", "http/curfew", "http/bare", "hop/builtin"}

// BenchmarkToolCall measures one tool call end to end, the caller's view: the test
// server's echo tool through toolrunner (Execute of st__echo / ht__echo, to the end of the
// stream) against a bare go-sdk client of the same server (CallTool), over stdio and
// over streamable HTTP, and the gRPC hop toolrunner adds on its own: Execute of a
// built-in that returns at once and touches no MCP server (fail with times 1, called as
// attempt 2, so that it succeeds; sleep refuses ms 0). Each iteration takes one sample
// of each case, in an order rotating with the iteration. Run with -benchtime=<n>x.
func BenchmarkToolCall(b *testing.B) {
	f := newToolFixture(b)
	echo := map[string]any{"text": "hello"}
	call := func(j int, run string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		var err error
		switch callCases[j] {
		case "stdio/curfew":
			_, err = execute(ctx, f.tr.client, run, "st__echo", `{"text": "hello"}`)
		case "http/curfew":
			_, err = execute(ctx, f.tr.client, run, "ht__echo", `{"text": "hello"}`)
		case "stdio/bare":
			_, err = f.bareSt.CallTool(ctx, &mcp.CallToolParams{Name: "echo", Arguments: echo})
		case "http/bare":
			_, err = f.bareHt.CallTool(ctx, &mcp.CallToolParams{Name: "echo", Arguments: echo})
		case "hop/builtin":
			// The built-in fail tool on an attempt past its failures: it returns at once.
			actx := metadata.AppendToOutgoingContext(ctx, md.Attempt, "2")
			_, err = execute(actx, f.tr.client, run, "fail", `{"times": 1}`)
		}
		return err
	}
	for i := range 20 { // warm-up
		for j := range callCases {
			if err := call(j, fmt.Sprintf("warm-%d", i)); err != nil {
				b.Fatal(callCases[j], ": ", err)
			}
		}
	}
	d := make([]Dist, len(callCases))
	i := 0
	for b.Loop() {
		for k := range callCases {
			j := (k + i) % len(callCases)
			run := fmt.Sprintf("bench-call-%d-%d", i, j)
			t0 := time.Now()
			if err := call(j, run); err != nil {
				b.Fatal(callCases[j], ": ", err)
			}
			d[j] = append(d[j], time.Since(t0))
		}
		i++
	}
	for j, c := range callCases {
		b.ReportMetric(float64(d[j].Quantile(.5))/1e3, strings.ReplaceAll(c, "/", "-")+"-p50-µs")
	}
	p50 := func(name string) time.Duration {
		for j, c := range callCases {
			if c == name {
				return d[j].Quantile(.5)
			}
		}
		return 0
	}
	hop := p50("hop/builtin")
	var sb strings.Builder
	fmt.Fprintf(&sb, "\ntool call: one echo call, caller's view (µs), %d samples per case\n", len(d[0]))
	sb.WriteString("| case | p50 | p90 | p99 | min |\n|---|---:|---:|---:|---:|\n")
	for j, c := range callCases {
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s |\n", c, us(d[j].Quantile(.5)), us(d[j].Quantile(.9)), us(d[j].Quantile(.99)), us(d[j].Min()))
	}
	for _, t := range []string{"stdio", "http"} {
		cur, bare := p50(t+"/curfew"), p50(t+"/bare")
		fmt.Fprintf(&sb, "%s: curfew p50 %s µs vs 1.2 × bare + hop = %s µs (%.2f × bare + %.2f × hop): met %v\n", t, us(cur),
			us(time.Duration(1.2*float64(bare))+hop), float64(cur)/float64(bare), float64(cur-bare)/float64(hop), cur <= time.Duration(1.2*float64(bare))+hop)
	}
	addReport(sb.String())
}

// BenchmarkToolMemory measures the memory of MCP sessions and calls in toolrunner:
//
//   - sessions: a toolrunner whose tools file names N stdio sources (the test server;
//     N = CURFEW_BENCH_MCP_SESSIONS, default 16), every one open, listed and idle after
//     one echo call, against a toolrunner with an empty tools file, each started fresh,
//     alternately, CURFEW_BENCH_MEM_ROUNDS times (default 3). Per session: the
//     difference of toolrunner's Rss, heap in use and goroutines, divided by N; the
//     servers' own Rss is given apart.
//   - inflight: one toolrunner with one stdio source, N concurrent Execute calls of its
//     wait tool (N = CURFEW_BENCH_TOOL_CALLS, default 1000), read after all N are in
//     flight against before them. It then cancels them and checks in the server's records
//     that all N handlers had started before the cancel.
//
// Figures are read from /proc/<pid>/smaps_rollup and toolrunner's /metrics after a
// settle pause. The benchmark runs once whatever -benchtime says.
func BenchmarkToolMemory(b *testing.B) {
	b.Run("sessions", func(b *testing.B) {
		n := envInt(b, "CURFEW_BENCH_MCP_SESSIONS", 16)
		rounds := envInt(b, "CURFEW_BENCH_MEM_ROUNDS", 3)
		_, bin := toolBins(b)
		var sb strings.Builder
		fmt.Fprintf(&sb, "\nidle MCP stdio sessions in toolrunner: %d sources vs none, fresh processes, alternating\n", n)
		sb.WriteString("| round | sources | toolrunner Rss MiB | heap in use MiB | goroutines | servers' Rss MiB (sum) |\n|---:|---:|---:|---:|---:|---:|\n")
		var perRSS, perHeap, perG []float64
		for r := range rounds {
			var st [2]procStats
			order := []int{0, n}
			if r%2 == 1 { // alternate which one goes first
				order = []int{n, 0}
			}
			for _, count := range order {
				s, servers := sessionsOnce(b, bin, count)
				idx := 0
				if count == n {
					idx = 1
				}
				st[idx] = s
				fmt.Fprintf(&sb, "| %d | %d | %.1f | %.1f | %.0f | %.1f |\n", r+1, count, mib(s.mem.RSS), s.heapInuse/(1<<20), s.goroutines, mib(servers))
			}
			perRSS = append(perRSS, float64(st[1].mem.RSS-st[0].mem.RSS)/float64(n))
			perHeap = append(perHeap, (st[1].heapInuse-st[0].heapInuse)/float64(n))
			perG = append(perG, (st[1].goroutines-st[0].goroutines)/float64(n))
		}
		fmt.Fprintf(&sb, "per session, each round: Rss KiB %s; heap KiB %s; goroutines %s\n", kibs(perRSS), kibs(perHeap), fmts(perG))
		b.ReportMetric(median(perRSS)/1024, "rss-KiB/session")
		b.ReportMetric(median(perHeap)/1024, "heap-KiB/session")
		b.ReportMetric(median(perG), "goroutines/session")
		addReport(sb.String())
	})
	b.Run("inflight", func(b *testing.B) {
		n := envInt(b, "CURFEW_BENCH_TOOL_CALLS", 1000)
		inflightOnce(b, n)
	})
}

// sessionsOnce starts a toolrunner with n stdio sources, waits until each has answered an
// echo call, settles and reads toolrunner's figures and the sum of its children's Rss.
func sessionsOnce(b *testing.B, bin string, n int) (procStats, int64) {
	var srcs []string
	var names []string
	for k := range n {
		srcs = append(srcs, fmt.Sprintf(`{"name": "s%d", "kind": "mcp_stdio", "command": %q}`, k, bin))
		names = append(names, fmt.Sprintf("s%d__echo", k))
	}
	tr := startToolrunner(b, `{"sources": [`+strings.Join(srcs, ",")+`]}`)
	defer tr.stop() // before the next one starts
	waitTools(b, tr.client, names, `{}`)
	waitTools(b, tr.client, []string{"sleep"}, `{"ms": 1}`)
	time.Sleep(memorySettle)
	st := readProc(b, tr)
	children := childPIDs(tr.cmd.Process.Pid)
	if len(children) != n {
		b.Fatalf("%d server processes under toolrunner, want %d", len(children), n)
	}
	var servers int64
	for _, pid := range children {
		if m, err := ReadMemory(pid); err == nil {
			servers += m.RSS
		}
	}
	return st, servers
}

// inflightOnce puts n wait calls in flight through toolrunner and reads what they cost.
func inflightOnce(b *testing.B, n int) {
	_, bin := toolBins(b)
	rec := &recordFile{path: filepath.Join(b.TempDir(), "st.jsonl")}
	tr := startToolrunner(b, fmt.Sprintf(`{"sources": [{"name": "st", "kind": "mcp_stdio", "command": %q, "args": ["--record", %q], "concurrency": %d}]}`,
		bin, rec.path, n+16))
	waitTools(b, tr.client, []string{"st__echo"}, `{}`)
	// Warm the paths with short waits that complete.
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Go(func() {
			_, _ = execute(context.Background(), tr.client, fmt.Sprintf("warm-%d", i), "st__wait", `{"ms": 10}`)
		})
	}
	wg.Wait()
	time.Sleep(memorySettle)
	before := readProc(b, tr)
	srv := childPIDs(tr.cmd.Process.Pid)
	if len(srv) != 1 {
		b.Fatalf("%d server processes under toolrunner, want 1", len(srv))
	}
	srvBefore, err := ReadMemory(srv[0])
	if err != nil {
		b.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), toolDeadline)
	defer cancel()
	clients := make([]toolrunnerv1.ToolRunnerServiceClient, 4)
	for i := range clients {
		clients[i] = tr.newConn(b)
	}
	errs := make(chan error, n)
	args := fmt.Sprintf(`{"ms": %d}`, toolWaitMS)
	for i := range n {
		wg.Go(func() {
			_, err := execute(ctx, clients[i%len(clients)], fmt.Sprintf("bench-inflight-%d", i), "st__wait", args)
			errs <- err
		})
	}
	// In flight: toolrunner holds a handler goroutine or more per call, and stays there.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		s := readProc(b, tr)
		if s.goroutines >= before.goroutines+float64(n) {
			break
		}
		if time.Now().After(deadline) {
			b.Fatalf("%0.f goroutines, %0.f before: the %d calls are not all in flight after 2 minutes", s.goroutines, before.goroutines, n)
		}
		select {
		case err := <-errs:
			b.Fatalf("a wait call ended early: %v", err)
		default:
		}
		time.Sleep(200 * time.Millisecond)
	}
	time.Sleep(memorySettle)
	after := readProc(b, tr)
	srvAfter, err := ReadMemory(srv[0])
	if err != nil {
		b.Fatal(err)
	}
	t0 := time.Now()
	cancel()
	wg.Wait()
	// Every handler had started before the cancel and saw its ctx end: all n were in the
	// server, not queued on the way.
	rec.seen = 33 // the echo and the 32 warm-up waits
	for k := range n {
		r, err := rec.next(30 * time.Second)
		if err != nil {
			b.Fatalf("record of call %d: %v", k, err)
		}
		if r.Tool != "wait" || r.StartedNS == 0 || r.StartedNS > t0.UnixNano() || r.CtxDoneNS == 0 {
			b.Fatalf("record %+v: not a wait in flight at the cancel", r)
		}
	}
	per := func(a, b float64) float64 { return (a - b) / float64(n) }
	rss := per(float64(after.mem.RSS), float64(before.mem.RSS))
	heap := per(after.heapInuse, before.heapInuse)
	stack := per(after.stackInuse, before.stackInuse)
	g := per(after.goroutines, before.goroutines)
	srvRSS := per(float64(srvAfter.RSS), float64(srvBefore.RSS))
	b.ReportMetric(rss/1024, "rss-KiB/call")
	b.ReportMetric(heap/1024, "heap-KiB/call")
	b.ReportMetric(g, "goroutines/call")
	addReport(fmt.Sprintf("\nin-flight MCP calls through toolrunner: %d wait calls over one stdio session\n"+
		"| | toolrunner Rss MiB | heap in use MiB | stack in use MiB | goroutines | server Rss MiB |\n|---|---:|---:|---:|---:|---:|\n"+
		"| before | %.1f | %.1f | %.1f | %.0f | %.1f |\n| in flight | %.1f | %.1f | %.1f | %.0f | %.1f |\n"+
		"| per call | %.1f KiB | %.1f KiB | %.1f KiB | %.2f | %.1f KiB |\n",
		n, mib(before.mem.RSS), before.heapInuse/(1<<20), before.stackInuse/(1<<20), before.goroutines, mib(srvBefore.RSS),
		mib(after.mem.RSS), after.heapInuse/(1<<20), after.stackInuse/(1<<20), after.goroutines, mib(srvAfter.RSS),
		rss/1024, heap/1024, stack/1024, g, srvRSS/1024))
}

// readProc reads toolrunner's Rss and its /metrics figures.
func readProc(tb testing.TB, tr *trProc) procStats {
	tb.Helper()
	mem, err := ReadMemory(tr.cmd.Process.Pid)
	if err != nil {
		tb.Fatal(err)
	}
	st := procStats{mem: mem}
	text, err := scrape(tr.admin)
	if err != nil {
		tb.Fatal(err)
	}
	var ok [3]bool
	st.goroutines, ok[0] = PromValue(text, "go_goroutines")
	st.heapInuse, ok[1] = PromValue(text, "go_memstats_heap_inuse_bytes")
	st.stackInuse, ok[2] = PromValue(text, "go_memstats_stack_inuse_bytes")
	if ok != [3]bool{true, true, true} {
		tb.Fatal(errors.New("toolrunner's /metrics lacks the Go runtime's figures"))
	}
	return st
}

// childPIDs lists the children of process pid (of all its threads).
func childPIDs(pid int) []int {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return nil
	}
	var out []int
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/children", pid, t.Name()))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
			}
		}
	}
	return out
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }

func kibs(v []float64) string {
	var s []string
	for _, x := range v {
		s = append(s, fmt.Sprintf("%.1f", x/1024))
	}
	return strings.Join(s, ", ")
}

func fmts(v []float64) string {
	var s []string
	for _, x := range v {
		s = append(s, fmt.Sprintf("%.2f", x))
	}
	return strings.Join(s, ", ")
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	for i := range s { // insertion sort: a handful of values
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
	return s[len(s)/2]
}
