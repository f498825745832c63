package drill

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// The drill's knobs: seed 003's (docs/drill.md), the defaults of `curfew drill`.
const (
	DefaultTasks     = 8
	DefaultDeadline  = 12 * time.Second
	DefaultCancelAt  = 3500 * time.Millisecond
	DefaultTPS       = 40
	DefaultHeartbeat = 4 * time.Second
	promptTokens     = 800
	paidCap          = 2
	critical         = 2 // tasks 0 and 1 are critical (paid); the rest sheddable (overflow)
	tenant           = "drill"
)

// faults are Config.Fault's faults by number (chaosFor has the chaos setting each sends),
// with the defence that should catch it.
var faults = map[int]struct{ name, defence string }{
	1: {"drop the cancel on overflow workers", "lease lapse"},
	2: {"heartbeats slower than the slack", "admission fail-closed"},
	3: {"a retry without its retry-id", "admission fail-closed"},
	4: {"tokens attributed to the worker instead of the task", "ledger keying"},
	5: {"a second decoder left running", "lease lapse"},
}

// Row is one task's line of the drill's output.
type Row struct {
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

// Config is one drill. Its zero LeaseTTL and SlowHeartbeat take the defaults of
// WithDefaults; Run wants them set.
type Config struct {
	Mode          string        // "shed" (curfew's cancel path) or "orphan" (propagation off: the naive baseline)
	Fault         int           // the fault injected, 1 to 5 (faults); 0 none
	Tasks         int           // tasks, all sharing one deadline; the first 2 critical, the rest sheddable
	Deadline      time.Duration // the tasks' shared deadline
	CancelAt      time.Duration // when the client cancels every task
	TPS           float64       // decode rate, tokens per second
	Heartbeat     time.Duration // decoder lease heartbeat period
	LeaseTTL      time.Duration // decoder lease TTL; 2 × Heartbeat when 0
	SlowHeartbeat time.Duration // fault 2's heartbeat period; Deadline/3 + 1s when 0
}

// WithDefaults returns c with its zero LeaseTTL and SlowHeartbeat set to their defaults.
func (c Config) WithDefaults() Config {
	if c.LeaseTTL == 0 {
		c.LeaseTTL = 2 * c.Heartbeat
	}
	if c.SlowHeartbeat == 0 {
		c.SlowHeartbeat = c.Deadline/3 + time.Second
	}
	return c
}

// chaosFor is the curfew-chaos header of the drill's tasks.
func (c Config) chaosFor() chaos.Settings {
	var s chaos.Settings
	if c.Mode == "orphan" {
		s.Orphan = true
	}
	switch c.Fault {
	case 1:
		s.DropCancel = true
	case 2:
		s.SlowHeartbeat = c.SlowHeartbeat
	case 4:
		s.WorkerLedger = true
	case 5:
		s.NoDedupe = true
	}
	return s
}

// prompt is the fixture prompt: n whitespace-separated tokens.
func prompt(n int) string {
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

// taskPlan is the plan of every task: one step that decodes 25 % past the deadline, its
// first attempt failed so that the retry layer retries it once with the same retry-id.
func taskPlan(cfg Config) string {
	n := int(math.Ceil(cfg.TPS * cfg.Deadline.Seconds() * 1.25))
	p := map[string]any{"tokens_per_second": cfg.TPS, "prompt": prompt(promptTokens),
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

// Run runs the drill's tasks on the orchestrator client talks to, waits until the
// deadline has passed, and returns one row per task. The orchestrator must run with
// --chaos when cfg injects a fault or runs in orphan mode.
func Run(ctx context.Context, client orchestratorv1.OrchestratorServiceClient, cfg Config) ([]Row, error) {
	task := taskPlan(cfg)
	cs := cfg.chaosFor()
	t0 := time.Now()
	dl := t0.Add(cfg.Deadline)
	cancelAt := t0.Add(cfg.CancelAt)
	res := make([]taskResult, cfg.Tasks)
	var wg sync.WaitGroup
	for i := range cfg.Tasks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i] = runTask(ctx, client, cfg, task, cs, i, dl, cancelAt)
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
	rows := make([]Row, cfg.Tasks)
	for i, r := range res {
		crit := "sheddable"
		if i < critical {
			crit = "critical"
		}
		row := Row{Task: fmt.Sprintf("t-%d", i), Criticality: crit, PromptTokens: promptTokens, StreamedTokens: r.streamed}
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
			computeRow(&row, run, cancelAt, cfg)
		}
		rows[i] = row
	}
	return rows, nil
}

func runTask(ctx context.Context, client orchestratorv1.OrchestratorServiceClient, cfg Config, task string, cs chaos.Settings, i int, dl, cancelAt time.Time) taskResult {
	crit := "sheddable"
	if i < critical {
		crit = "critical"
	}
	kv := []string{md.Tenant, tenant, md.Criticality, crit}
	if v := cs.String(); v != "" {
		kv = append(kv, md.Chaos, v)
	}
	if cfg.Fault == 3 {
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
		return failed(r, err)
	}
	perNode := map[string]int64{}
	var mu sync.Mutex
	for {
		ev, err := stream.Recv()
		if err != nil {
			if !r.started {
				return failed(r, err)
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

// failed files a failed Run call: a shed is a result, anything else an error (a
// cancel before the run started is neither).
func failed(r taskResult, err error) taskResult {
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
		resp, err := client.GetRun(metadata.AppendToOutgoingContext(ctx, md.Tenant, tenant), &orchestratorv1.GetRunRequest{RunId: id})
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
