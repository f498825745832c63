package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

// `curfew drill`: seed 003's cancel-and-shed drill across the real services
// (docs/drill.md). Every task runs one model step decoding past the deadline, whose first
// attempt fails (a sim plan model_error) so the retry layer retries it with the same
// retry-id; the client cancels every task at --cancel-at; after the deadline the drill
// reads each run's summary and prints one row per task, then a VERDICT line.

// Drill knobs: seed 003's, written on the whiteboard before the drill.
const (
	drillTasks        = 8
	drillDeadline     = 12 * time.Second
	drillCancelAt     = 3500 * time.Millisecond
	drillTPS          = 40
	drillHeartbeat    = 4 * time.Second
	drillPromptTokens = 800
	drillPaidCap      = 2
	drillCritical     = 2 // tasks 0 and 1 are critical (paid); the rest sheddable (overflow)
	drillTenant       = "drill"
)

// Faults of --fault, by number, with the chaos setting each sends and the defence that
// should catch it.
var drillFaults = map[int]struct{ name, defence string }{
	1: {"drop the cancel on overflow workers", "lease lapse"},
	2: {"heartbeats slower than the slack", "admission fail-closed"},
	3: {"a retry without its retry-id", "admission fail-closed"},
	4: {"tokens attributed to the worker instead of the task", "ledger keying"},
	5: {"a second decoder left running", "lease lapse"},
}

// DrillRow is one task's line of the drill's output.
type DrillRow struct {
	Task            string `json:"task"`
	RetryID         string `json:"retry_id"`
	Criticality     string `json:"criticality"`
	PromptTokens    int    `json:"prompt_tokens"`
	DeadlineSlackMS int64  `json:"deadline_slack_ms"`
	LeaseAgeMS      int64  `json:"lease_age_ms"`
	// OrphanTokenDelta is the tokens decoded after the client's cancel beyond the one
	// token per decoder already being emitted when the stop signal left (
	// nodes.OrphanTokens, the same definition admission uses);
	// TokensAfterCancel below is the raw count.
	OrphanTokenDelta  int64  `json:"orphan_token_delta"`
	DuplicateInFlight int    `json:"duplicate_in_flight"`
	TokensAtCancel    int64  `json:"tokens_at_cancel"`
	TokensAtDeadline  int64  `json:"tokens_at_deadline"`
	ShedReason        string `json:"shed_reason"`
	// Beyond the seed's fields: the run, the tokens the client saw streamed before its
	// cancel (the decoders' own count, for the ledger cross-check), how many decoders
	// the task had, and what stopped the decoders still running at the cancel.
	RunID          string `json:"run_id,omitempty"`
	StreamedTokens int64  `json:"streamed_tokens"`
	Decoders       int    `json:"decoders"`
	StoppedBy      string `json:"stopped_by,omitempty"`
	// TokensAfterCancel is every token decoded after the cancel instant, the in-flight
	// one included.
	TokensAfterCancel int64 `json:"tokens_after_cancel"`
}

type drillConfig struct {
	mode                string
	fault               int
	tasks               int
	deadline, cancelAt  time.Duration
	tps                 float64
	heartbeat, leaseTTL time.Duration
	slowHeartbeat       time.Duration
}

// chaosFor is the curfew-chaos header of the drill's tasks.
func (c drillConfig) chaosFor() chaos.Settings {
	var s chaos.Settings
	if c.mode == "orphan" {
		s.Orphan = true
	}
	switch c.fault {
	case 1:
		s.DropCancel = true
	case 2:
		s.SlowHeartbeat = c.slowHeartbeat
	case 4:
		s.WorkerLedger = true
	case 5:
		s.NoDedupe = true
	}
	return s
}

func cmdDrill(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("drill", stderr)
	var c common
	c.register(fs)
	var cfg drillConfig
	fs.StringVar(&cfg.mode, "mode", "shed", "shed (curfew's cancel path) or orphan (propagation switched off: the naive baseline)")
	fs.IntVar(&cfg.fault, "fault", 0, "inject one of seed 003's faults, 1 to 5 (docs/drill.md); 0 none")
	fs.IntVar(&cfg.tasks, "tasks", drillTasks, "tasks, all sharing one deadline; the first 2 are critical (paid pool), the rest sheddable (overflow)")
	fs.DurationVar(&cfg.deadline, "deadline", drillDeadline, "the tasks' shared deadline")
	fs.DurationVar(&cfg.cancelAt, "cancel-at", drillCancelAt, "when the client cancels every task")
	fs.Float64Var(&cfg.tps, "tps", drillTPS, "decode rate, tokens per second")
	fs.DurationVar(&cfg.heartbeat, "heartbeat", drillHeartbeat, "decoder lease heartbeat period")
	fs.DurationVar(&cfg.leaseTTL, "lease-ttl", 0, "decoder lease TTL; default 2 × --heartbeat, so that a lapse can come before the deadline (docs/drill.md)")
	fs.DurationVar(&cfg.slowHeartbeat, "slow-heartbeat", 0, "fault 2's heartbeat period; default --deadline/3 + 1s")
	binDir := fs.String("bin-dir", "", "directory of the service binaries for the drill's own mesh (default: next to curfew, else $PATH)")
	if _, err := parse(fs, args); err != nil {
		return usageErr(stderr, "drill", err)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if cfg.leaseTTL == 0 {
		cfg.leaseTTL = 2 * cfg.heartbeat
	}
	if cfg.slowHeartbeat == 0 {
		cfg.slowHeartbeat = cfg.deadline/3 + time.Second
	}
	switch {
	case cfg.mode != "shed" && cfg.mode != "orphan":
		return usageErr(stderr, "drill", fmt.Errorf("--mode must be shed or orphan, got %q", cfg.mode))
	case cfg.fault < 0 || cfg.fault > 5:
		return usageErr(stderr, "drill", fmt.Errorf("--fault must be 1 to 5, got %d", cfg.fault))
	case cfg.fault != 0 && cfg.mode == "orphan":
		return usageErr(stderr, "drill", errors.New("--fault goes with --mode shed: one break at a time"))
	case cfg.tasks < 1 || cfg.tasks > 64:
		return usageErr(stderr, "drill", fmt.Errorf("--tasks must be 1 to 64, got %d", cfg.tasks))
	case cfg.deadline < time.Second || cfg.cancelAt <= 0 || cfg.cancelAt >= cfg.deadline:
		return usageErr(stderr, "drill", errors.New("--deadline must be at least 1s and --cancel-at between 0 and the deadline"))
	case cfg.tps <= 0 || cfg.tps > 1000:
		return usageErr(stderr, "drill", fmt.Errorf("--tps must be in (0, 1000], got %v", cfg.tps))
	case cfg.heartbeat < 50*time.Millisecond || cfg.leaseTTL < cfg.heartbeat:
		return usageErr(stderr, "drill", errors.New("--heartbeat must be at least 50ms and --lease-ttl at least the heartbeat"))
	}
	var conn *grpc.ClientConn
	if set["addr"] || set["data-dir"] || c.addr != "" {
		// Another mesh: the client commands' connection, with its API key if any.
		var err error
		if conn, err = c.dial(); err != nil {
			return callErr(stderr, "drill", err)
		}
	} else {
		// Free ports are picked, released, then bound by the services: another process
		// may take one meanwhile (drills run side by side), so try a few times.
		var m *drillMesh
		var err error
		for try := 0; try < 3; try++ {
			if m, err = startDrillMesh(ctx, cfg, *binDir); err == nil || ctx.Err() != nil {
				break
			}
		}
		if err != nil {
			fmt.Fprintln(stderr, "curfew drill:", err)
			return ExitFail
		}
		defer m.stop()
		creds, err := clientCredentials(m.tlsDir, meshtls.Orchestrator)
		if err != nil {
			return callErr(stderr, "drill", err)
		}
		if conn, err = grpc.NewClient(m.addr, grpc.WithTransportCredentials(creds), withTracing()); err != nil {
			return callErr(stderr, "drill", err)
		}
	}
	defer conn.Close()
	rows, err := runDrill(ctx, orchestratorv1.NewOrchestratorServiceClient(conn), cfg)
	if err != nil {
		fmt.Fprintf(stderr, "curfew drill: %v\n", err)
		return ExitFail
	}
	for _, r := range rows {
		b, _ := json.Marshal(r)
		fmt.Fprintln(stdout, string(b))
	}
	v, ok := drillVerdict(cfg, rows)
	if !c.json {
		fmt.Fprintln(stdout, "VERDICT: "+v)
	}
	if !ok {
		return ExitFail
	}
	return ExitOK
}

// drillMesh is the drill's own mesh: the four services on free loopback ports, with
// --chaos, the paid pool capped at 2 and the drill's lease settings, in a temporary data
// directory removed with it (seed 003: park the drill on an isolated replica, then tear
// it down).
type drillMesh struct {
	addr     string
	tlsDir   string // its mTLS files, under dir
	dir      string
	children []*child
}

func startDrillMesh(ctx context.Context, cfg drillConfig, binDir string) (*drillMesh, error) {
	bins, err := findBinaries(binDir)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "curfew-drill-")
	if err != nil {
		return nil, err
	}
	m := &drillMesh{dir: dir}
	adm := map[string]any{"pools": []map[string]any{
		{"name": "paid", "max_in_flight": drillPaidCap},
		{"name": "overflow", "max_in_flight": max(cfg.tasks, 1), "overflow": true},
	}}
	b, _ := json.Marshal(adm)
	admFile := filepath.Join(dir, "admission.json")
	if err := os.WriteFile(admFile, b, 0o600); err != nil {
		m.stop()
		return nil, err
	}
	if err := os.MkdirAll(filepath.Join(dir, "logs"), 0o755); err != nil { //nolint:gosec // the user's own logs, which hold no secrets
		m.stop()
		return nil, err
	}
	eps, err := allocate(0)
	if err != nil {
		m.stop()
		return nil, err
	}
	if m.tlsDir, err = prepareTLS(filepath.Join(dir, TLSSubdir)); err != nil {
		m.stop()
		return nil, err
	}
	extra := map[string][]string{
		"orchestrator": {"--admission-config", admFile, "--decoder-heartbeat", cfg.heartbeat.String(), "--decoder-lease-ttl", cfg.leaseTTL.String()},
		"modelproxy":   {"--decoder-lease-ttl", cfg.leaseTTL.String()},
	}
	for _, name := range services {
		ch, err := startChild(name, bins[name], eps, dir, append([]string{"--chaos", "--shutdown-grace", "2s", "--tls-dir", m.tlsDir}, extra[name]...))
		if err != nil {
			m.stop()
			return nil, err
		}
		m.children = append(m.children, ch)
	}
	if err := waitServing(ctx, m.children, 30*time.Second, m.tlsDir); err != nil {
		m.stop()
		return nil, fmt.Errorf("%w (logs in %s)", err, filepath.Join(dir, "logs"))
	}
	m.addr = eps["orchestrator"].Addr
	return m, nil
}

func (m *drillMesh) stop() {
	for i := len(m.children) - 1; i >= 0; i-- {
		stopChild(m.children[i], 5*time.Second)
	}
	_ = os.RemoveAll(m.dir)
}

// drillPrompt is the fixture prompt: n whitespace-separated tokens.
func drillPrompt(n int) string {
	w := []string{"the", "queue", "looks", "calm", "while", "tokens", "still", "climb"}
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(w[i%len(w)])
	}
	return b.String()
}

// drillTask is the plan of every task: one step that decodes 25 % past the deadline, its
// first attempt failed so that the retry layer retries it once with the same retry-id.
func drillTask(cfg drillConfig) string {
	n := int(math.Ceil(cfg.tps * cfg.deadline.Seconds() * 1.25))
	p := map[string]any{"tokens_per_second": cfg.tps, "prompt": drillPrompt(drillPromptTokens),
		"steps": []map[string]any{{"answer_tokens": n, "model_error": map[string]any{"attempts": 1}}}}
	b, _ := json.Marshal(p)
	return string(b)
}

// taskResult is what the client saw of one task.
type taskResult struct {
	runID     string
	shed      *admission.ShedError
	streamed  int64 // model tokens streamed before the cancel
	chaosEcho bool  // the orchestrator echoed the chaos header: it runs with --chaos
	started   bool
	err       error
}

func runDrill(ctx context.Context, client orchestratorv1.OrchestratorServiceClient, cfg drillConfig) ([]DrillRow, error) {
	task := drillTask(cfg)
	cs := cfg.chaosFor()
	t0 := time.Now()
	dl := t0.Add(cfg.deadline)
	cancelAt := t0.Add(cfg.cancelAt)
	res := make([]taskResult, cfg.tasks)
	var wg sync.WaitGroup
	for i := range cfg.tasks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i] = runDrillTask(ctx, client, cfg, task, cs, i, dl, cancelAt)
		}()
	}
	wg.Wait()
	needChaos := cs.Any()
	for _, r := range res {
		if r.err != nil {
			return nil, r.err
		}
		if needChaos && r.started && !r.chaosEcho {
			return nil, errors.New("the mesh does not honour chaos settings: start its services with --chaos (CURFEW_CHAOS=true), or run the drill without --addr/--data-dir so that it starts its own mesh")
		}
	}
	// tokens_at_deadline: read once the deadline has passed and every run has ended.
	if wait := time.Until(dl.Add(500 * time.Millisecond)); wait > 0 {
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	rows := make([]DrillRow, cfg.tasks)
	for i, r := range res {
		crit := "sheddable"
		if i < drillCritical {
			crit = "critical"
		}
		row := DrillRow{Task: fmt.Sprintf("t-%d", i), Criticality: crit, PromptTokens: drillPromptTokens, StreamedTokens: r.streamed}
		switch {
		case r.shed != nil:
			row.ShedReason = string(r.shed.Reason)
			if r.shed.Condition != "" {
				row.ShedReason += ":" + r.shed.Condition
			}
			row.PromptTokens = 0
		case r.runID != "":
			run, err := awaitEnded(ctx, client, r.runID, dl.Add(30*time.Second))
			if err != nil {
				return nil, fmt.Errorf("task %s: %w", row.Task, err)
			}
			computeDrillRow(&row, run, cancelAt, cfg)
		}
		rows[i] = row
	}
	return rows, nil
}

func runDrillTask(ctx context.Context, client orchestratorv1.OrchestratorServiceClient, cfg drillConfig, task string, cs chaos.Settings, i int, dl, cancelAt time.Time) taskResult {
	crit := "sheddable"
	if i < drillCritical {
		crit = "critical"
	}
	kv := []string{md.Tenant, drillTenant, md.Criticality, crit}
	if v := cs.String(); v != "" {
		kv = append(kv, md.Chaos, v)
	}
	if cfg.fault == 3 {
		// Fault 3: the task's Run sent again as a retry that lost its retry-id.
		kv = append(kv, md.Attempt, "2")
	}
	cctx, cancel := context.WithDeadline(metadata.AppendToOutgoingContext(ctx, kv...), dl)
	defer cancel()
	stop := time.AfterFunc(time.Until(cancelAt), cancel) // the client's cancel
	defer stop.Stop()
	var r taskResult
	stream, err := client.Run(cctx, &orchestratorv1.RunRequest{Task: task})
	if err != nil {
		return drillErr(r, err)
	}
	perNode := map[string]int64{}
	var mu sync.Mutex
	for {
		ev, err := stream.Recv()
		if err != nil {
			if !r.started {
				return drillErr(r, err)
			}
			return r // the cancel, or the run's end
		}
		switch e := ev.GetEvent().(type) {
		case *orchestratorv1.RunResponse_Started:
			r.runID, r.started = e.Started.GetRunId(), true
			if h, err := stream.Header(); err == nil && len(h.Get(md.Chaos)) > 0 {
				r.chaosEcho = true
			}
		case *orchestratorv1.RunResponse_Node:
			if n := e.Node; n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL && time.Now().Before(cancelAt) {
				mu.Lock()
				perNode[n.GetId()] = max(perNode[n.GetId()], n.GetTokens())
				var sum int64
				for _, v := range perNode {
					sum += v
				}
				r.streamed = sum
				mu.Unlock()
			}
		}
	}
}

// drillErr files a failed Run call: a shed is a result, anything else an error (a
// cancel before the run started is neither).
func drillErr(r taskResult, err error) taskResult {
	if se, ok := admission.AsShed(err); ok {
		r.shed = se
		return r
	}
	r.err = fmt.Errorf("run: %w", err)
	return r
}

// awaitEnded reads the run until it has ended, up to limit.
func awaitEnded(ctx context.Context, client orchestratorv1.OrchestratorServiceClient, id string, limit time.Time) (*orchestratorv1.Run, error) {
	for {
		// The run is the drill tenant's: another tenant would be told NOT_FOUND.
		resp, err := client.GetRun(metadata.AppendToOutgoingContext(ctx, md.Tenant, drillTenant), &orchestratorv1.GetRunRequest{RunId: id})
		if err != nil {
			return nil, err
		}
		r := resp.GetRun()
		if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING || time.Now().After(limit) {
			return r, nil
		}
		select {
		case <-time.After(200 * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// computeDrillRow fills row's figures from the run's summary: its model nodes (decoders)
// with their ledger figures split at the run's cancel instant (the client's, as the
// orchestrator recorded it), else at cancelAt.
func computeDrillRow(row *DrillRow, run *orchestratorv1.Run, cancelAt time.Time, cfg drillConfig) {
	row.RunID = run.GetRunId()
	if run.GetCancelledAt() != nil {
		cancelAt = run.GetCancelledAt().AsTime()
	}
	var main *meshv1.Node
	var stopped []string
	byRetry := map[string][]drillSpan{}
	end := func(ts interface{ AsTime() time.Time }, ok bool) time.Time {
		if !ok {
			return time.Now() // still running
		}
		return ts.AsTime()
	}
	for _, n := range run.GetNodes() {
		if n.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL {
			continue
		}
		row.Decoders++
		row.TokensAtCancel += n.GetTokensAtCancel()
		row.TokensAtDeadline += n.GetTokens()
		row.TokensAfterCancel += n.GetTokensAfterCancel()
		row.OrphanTokenDelta += nodes.OrphanTokens(n)
		if main == nil || (!strings.Contains(n.GetId(), "~") && strings.Contains(main.GetId(), "~")) {
			main = n
		}
		if n.GetTokensAfterCancel() > 0 || (n.GetEndedAt() != nil && n.GetEndedAt().AsTime().After(cancelAt.Add(time.Second))) {
			stopped = append(stopped, causeName(n.GetCause()))
		}
		if rid := n.GetRetryId(); rid != "" {
			byRetry[rid] = append(byRetry[rid], drillSpan{n.GetStartedAt().AsTime(), end(n.GetEndedAt(), n.GetEndedAt() != nil)})
			for _, a := range n.GetEarlierAttempts() {
				byRetry[rid] = append(byRetry[rid], drillSpan{a.GetStartedAt().AsTime(), end(a.GetEndedAt(), a.GetEndedAt() != nil)})
			}
		}
	}
	if main != nil {
		row.RetryID = main.GetRetryId()
		if main.GetDeadline() != nil && main.GetStartedAt() != nil {
			row.DeadlineSlackMS = main.GetDeadline().AsTime().Sub(main.GetStartedAt().AsTime()).Milliseconds()
		}
		row.LeaseAgeMS = leaseAge(main, cancelAt, cfg).Milliseconds()
	}
	for _, spans := range byRetry {
		row.DuplicateInFlight = max(row.DuplicateInFlight, maxOverlap(spans)-1)
	}
	sort.Strings(stopped)
	row.StoppedBy = strings.Join(dedupe(stopped), ",")
	row.ShedReason = causeName(run.GetCause())
	if row.ShedReason == "-" {
		row.ShedReason = ""
	}
}

// leaseAge is the age of the decoder's lease renewal at the cancel instant, derived from
// the keeper's rule (renewed every min(heartbeat, remaining/3) from the decoder's start;
// every fault-2 period under slow-heartbeat): modelproxy does not report renewals per
// decoder. 0 when the decoder had ended by then.
func leaseAge(n *meshv1.Node, cancelAt time.Time, cfg drillConfig) time.Duration {
	if n.GetStartedAt() == nil || n.GetStartedAt().AsTime().After(cancelAt) {
		return 0
	}
	if n.GetEndedAt() != nil && n.GetEndedAt().AsTime().Before(cancelAt) {
		return 0
	}
	last := n.GetStartedAt().AsTime()
	var dl time.Time
	if n.GetDeadline() != nil {
		dl = n.GetDeadline().AsTime()
	}
	for i := 0; i < 10000; i++ {
		p := cfg.heartbeat
		if cfg.fault == 2 {
			p = cfg.slowHeartbeat
		} else if !dl.IsZero() {
			p = min(p, dl.Sub(last)/3)
		}
		p = max(p, 50*time.Millisecond)
		if last.Add(p).After(cancelAt) {
			break
		}
		last = last.Add(p)
	}
	return cancelAt.Sub(last)
}

// drillSpan is when one decoder (an attempt) ran.
type drillSpan struct{ start, end time.Time }

// maxOverlap is the most spans open at one instant.
func maxOverlap(spans []drillSpan) int {
	type ev struct {
		at    time.Time
		delta int
	}
	var evs []ev
	for _, s := range spans {
		evs = append(evs, ev{s.start, 1}, ev{s.end, -1})
	}
	sort.Slice(evs, func(i, j int) bool {
		if evs[i].at.Equal(evs[j].at) {
			return evs[i].delta < evs[j].delta // an end before a start at the same instant
		}
		return evs[i].at.Before(evs[j].at)
	})
	cur, best := 0, 0
	for _, e := range evs {
		cur += e.delta
		best = max(best, cur)
	}
	return best
}

func dedupe(s []string) []string {
	var out []string
	for i, v := range s {
		if i == 0 || v != s[i-1] {
			out = append(out, v)
		}
	}
	return out
}

// drillBounds are the orphan tokens per decoder each defence allows, beyond the in-flight
// allowance: a cancel stops a decoder at its next token boundary (none); a lease lapse
// within one lease TTL of decode after the caller's last renewal.
func drillBounds(cfg drillConfig) (cancelBound, leaseBound int64) {
	return 0, int64(math.Ceil(cfg.leaseTTL.Seconds() * cfg.tps))
}

// drillVerdict judges the rows: the VERDICT line and whether the drill passed (no
// leak beyond the bound of the defence in effect; a fault caught).
func drillVerdict(cfg drillConfig, rows []DrillRow) (string, bool) {
	cancelBound, leaseBound := drillBounds(cfg)
	var orphan, atCancel, atDeadline, streamed, ledger int64
	var ran, leaked, dup, lapsed, shedBy int
	var leakTasks []string
	cond := map[int]string{2: string(admission.ConditionSlowHeartbeat), 3: string(admission.ConditionRetryWithoutID)}[cfg.fault]
	for _, r := range rows {
		orphan += r.OrphanTokenDelta
		atCancel += r.TokensAtCancel
		atDeadline += r.TokensAtDeadline
		streamed += r.StreamedTokens
		if r.RunID != "" {
			ran++
			ledger += r.TokensAtDeadline
		}
		if r.DuplicateInFlight > 0 {
			dup++
		}
		if strings.Contains(r.StoppedBy, "lease_expired") {
			lapsed++
		}
		if cond != "" && strings.Contains(r.ShedReason, cond) {
			shedBy++
		}
		bound := cancelBound * int64(max(r.Decoders, 1))
		if cfg.fault == 1 && r.Criticality == "sheddable" || cfg.fault == 5 {
			bound += leaseBound
		}
		if r.OrphanTokenDelta > bound {
			leaked++
			leakTasks = append(leakTasks, r.Task)
		}
	}
	avg := func(v int64) int64 {
		if ran == 0 {
			return 0
		}
		return v / int64(ran)
	}
	if cfg.mode == "orphan" {
		if leaked > 0 {
			return fmt.Sprintf("orphan decode after cancel: %d of %d tasks decoded %d tokens after the client's cancel (per task: tokens_at_cancel ≈ %d, tokens_at_deadline ≈ %d); propagation was off",
				leaked, len(rows), orphan, avg(atCancel), avg(atDeadline)), false
		}
		return fmt.Sprintf("unexpected shed: the orphan baseline leaked nothing (%d orphan tokens)", orphan), false
	}
	if cfg.fault == 0 {
		if leaked == 0 && dup == 0 {
			return fmt.Sprintf("shed within grace: %d tasks, %d orphan tokens (bound %d per decoder), no duplicate decoder; tokens_at_cancel ≈ %d per task",
				len(rows), orphan, cancelBound, avg(atCancel)), true
		}
		return fmt.Sprintf("cancel missed: %d tasks leaked %d orphan tokens (%s), %d with a duplicate decoder", leaked, orphan, strings.Join(leakTasks, ","), dup), false
	}
	f := drillFaults[cfg.fault]
	head := fmt.Sprintf("fault %d (%s)", cfg.fault, f.name)
	within := fmt.Sprintf("%d orphan tokens", orphan)
	if leaked > 0 {
		return fmt.Sprintf("%s NOT caught: %d tasks leaked beyond the bound (%s), %s", head, leaked, strings.Join(leakTasks, ","), within), false
	}
	sheddable := 0
	for _, r := range rows {
		if r.Criticality == "sheddable" {
			sheddable++
		}
	}
	switch cfg.fault {
	case 1:
		if lapsed < sheddable {
			return fmt.Sprintf("%s NOT caught by the lease: %d of %d overflow decoders stopped by a lease lapse (the deadline or nothing stopped the rest); %s", head, lapsed, sheddable, within), false
		}
		return fmt.Sprintf("%s caught by %s: %d overflow decoders, whose cancel was dropped, stopped by themselves when their lease lapsed; cost %d orphan tokens (bound %d per decoder: one lease TTL of %v at %v tokens/s)",
			head, f.defence, lapsed, orphan, leaseBound, cfg.leaseTTL, cfg.tps), true
	case 2, 3:
		if shedBy < sheddable {
			return fmt.Sprintf("%s NOT caught: %d of %d overflow tasks shed with pool_closed (%s)", head, shedBy, sheddable, cond), false
		}
		return fmt.Sprintf("%s caught by %s: %d overflow tasks shed with pool_closed (%s) before any decode; the paid tasks ran and were cancelled; cost %d orphan tokens",
			head, f.defence, shedBy, cond, orphan), true
	case 4:
		if streamed <= ledger {
			return fmt.Sprintf("%s NOT caught: the per-task ledger (%d tokens) agrees with the %d tokens the decoders streamed", head, ledger, streamed), false
		}
		return fmt.Sprintf("%s caught by %s: the per-task ledger holds %d tokens where the decoders streamed %d; cost %d tokens unattributed to any task; %s",
			head, f.defence, ledger, streamed, streamed-ledger, within), true
	case 5:
		if dup == 0 || lapsed < dup {
			return fmt.Sprintf("%s NOT caught: %d tasks had a second decoder, %d stopped by a lease lapse", head, dup, lapsed), false
		}
		return fmt.Sprintf("%s caught by %s (retry-id dedupe was off): %d tasks had a second decoder of the same retry-id, each stopped when its unrenewed lease lapsed; cost %d orphan tokens (bound %d per decoder), %d tokens in all",
			head, f.defence, dup, orphan, leaseBound, atDeadline), true
	}
	return head, false
}
