package soak

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sort"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// Kind is one kind of run in the mix.
type Kind string

// The kinds of runs.
const (
	// Tools: a model step, two tools in parallel (sleep and the durable kv_put, with an
	// idempotency key), and an answering model step. ToolFailRate of them call the fail
	// tool too, whose error the loop hands to the model: the run still succeeds.
	Tools Kind = "tools"
	// MCP: one call of the MCP server's effect tool (Mix.MCPTool), which does its effect
	// once per idempotency key, then an answer.
	MCP Kind = "mcp"
	// Subagent: spawn_subagent of a Tools plan, then an answer.
	Subagent Kind = "subagent"
	// Failing: a model step whose provider refuses it (INVALID_ARGUMENT, not retried):
	// the run fails.
	Failing Kind = "failing"
	// Cancelled: two subagents decoding for a long time; the client cancels the run
	// between CancelMin and CancelMax after its start.
	Cancelled Kind = "cancelled"
	// Deadline: a long decode under a DeadlineTimeout: the run ends past its deadline.
	Deadline Kind = "deadline"
)

// Mix is the load's mix of runs.
type Mix struct {
	// Weights is each kind's share (relative); kinds absent or 0 are not run. MCP needs
	// MCPTool.
	Weights map[Kind]int `json:"weights"`
	// StepTokens is the tokens of each model step of the short kinds, at
	// TokensPerSecond.
	StepTokens      int     `json:"step_tokens"`
	TokensPerSecond float64 `json:"tokens_per_second"`
	// ToolMS is the sleep tool's duration in the Tools kind.
	ToolMS int `json:"tool_ms"`
	// ToolFailRate is the share of Tools runs that also call the fail tool.
	ToolFailRate float64 `json:"tool_fail_rate"`
	// MCPTool is the effect tool's name as plans call it (<source>__effect); "" leaves
	// MCP out.
	MCPTool string `json:"mcp_tool,omitempty"`
	// LongTokensPerSecond is the decode rate of the Cancelled and Deadline kinds, whose
	// decoders would run for minutes if not stopped.
	LongTokensPerSecond float64 `json:"long_tokens_per_second"`
	// CancelMin and CancelMax bound when a Cancelled run is cancelled after its start.
	CancelMin time.Duration `json:"cancel_min"`
	CancelMax time.Duration `json:"cancel_max"`
	// DeadlineTimeout is the Deadline kind's timeout; Timeout every other run's.
	DeadlineTimeout time.Duration `json:"deadline_timeout"`
	Timeout         time.Duration `json:"timeout"`
}

// DefaultMix is the soak's mix, paced as agents are: model steps of 50 tokens streamed at
// 50 tokens/s (a hosted model's stream), tools that take 2 s (an API call, a search),
// long decodes at 100 tokens/s cancelled 1 to 3 s after their start or cut by a 2 s
// deadline, and 5 % of tools runs calling a tool that fails. A Tools run so lasts about
// 4 s, and 200 runs in flight offer about 60 runs/s.
func DefaultMix() Mix {
	return Mix{
		Weights:             map[Kind]int{Tools: 40, MCP: 15, Subagent: 15, Failing: 5, Cancelled: 15, Deadline: 10},
		StepTokens:          50,
		TokensPerSecond:     50,
		ToolMS:              2000,
		ToolFailRate:        0.05,
		LongTokensPerSecond: 100,
		CancelMin:           time.Second,
		CancelMax:           3 * time.Second,
		DeadlineTimeout:     2 * time.Second,
		Timeout:             time.Minute,
	}
}

// kinds returns the kinds run, in a fixed order, and their cumulative weights.
func (m Mix) kinds() ([]Kind, []int) {
	var ks []Kind
	for k, w := range m.Weights {
		if w > 0 && (k != MCP || m.MCPTool != "") {
			ks = append(ks, k)
		}
	}
	sort.Slice(ks, func(i, j int) bool { return ks[i] < ks[j] })
	cum := make([]int, len(ks))
	total := 0
	for i, k := range ks {
		total += m.Weights[k]
		cum[i] = total
	}
	return ks, cum
}

// Validate reports a mix that cannot run.
func (m Mix) Validate() error {
	for k, w := range m.Weights {
		switch k {
		case Tools, MCP, Subagent, Failing, Cancelled, Deadline:
		default:
			return fmt.Errorf("mix: unknown kind %q", k)
		}
		if w < 0 {
			return fmt.Errorf("mix: kind %s has a negative weight", k)
		}
	}
	if ks, _ := m.kinds(); len(ks) == 0 {
		return fmt.Errorf("mix: no kind to run (MCP needs an MCP tool)")
	}
	switch {
	case m.StepTokens < 1 || m.TokensPerSecond <= 0 || m.LongTokensPerSecond <= 0:
		return fmt.Errorf("mix: step tokens and decode rates must be positive")
	case m.CancelMin <= 0 || m.CancelMax < m.CancelMin:
		return fmt.Errorf("mix: want 0 < cancel_min <= cancel_max")
	case m.DeadlineTimeout <= 0 || m.Timeout <= m.DeadlineTimeout:
		return fmt.Errorf("mix: want 0 < deadline_timeout < timeout")
	case m.ToolFailRate < 0 || m.ToolFailRate > 1:
		return fmt.Errorf("mix: tool_fail_rate is a share, 0 to 1")
	}
	return nil
}

// pick draws a kind.
func (m Mix) pick(rnd *rand.Rand) Kind {
	ks, cum := m.kinds()
	n := rnd.IntN(cum[len(cum)-1])
	for i, c := range cum {
		if n < c {
			return ks[i]
		}
	}
	return ks[len(ks)-1]
}

// longTokens is the decode of the Cancelled and Deadline kinds: far longer than any
// cancel or deadline of the mix.
const longTokens = 1_000_000

// request is the run of kind k named name (unique to the load and the run: it keys the
// run's start and its side effects), and when its client cancels it (0: never).
func (m Mix) request(k Kind, name string, rnd *rand.Rand) (*orchestratorv1.StartRunRequest, time.Duration) {
	timeout := m.Timeout
	var cancelAfter time.Duration
	var p plan.Plan
	switch k {
	case Tools:
		p = m.toolsPlan(name, rnd)
	case MCP:
		p = plan.Plan{TokensPerSecond: m.TokensPerSecond, Steps: []plan.Step{
			{Tools: []plan.Tool{{Name: m.MCPTool, IdempotencyKey: name + "/mcp"}}},
			{AnswerTokens: m.StepTokens},
		}}
	case Subagent:
		p = plan.Plan{TokensPerSecond: m.TokensPerSecond, Steps: []plan.Step{
			{Tools: []plan.Tool{{Name: plan.ToolSpawnSubagent, Args: args(map[string]any{"plan": m.toolsPlan(name, rnd)})}}},
			{AnswerTokens: m.StepTokens},
		}}
	case Failing:
		p = plan.Plan{TokensPerSecond: m.TokensPerSecond, Steps: []plan.Step{
			{AnswerTokens: m.StepTokens, ModelError: &plan.Fault{Attempts: 100, Code: "INVALID_ARGUMENT"}},
		}}
	case Cancelled:
		long := plan.Plan{TokensPerSecond: m.LongTokensPerSecond, Steps: []plan.Step{{AnswerTokens: longTokens}}}
		spawn := plan.Tool{Name: plan.ToolSpawnSubagent, Args: args(map[string]any{"plan": long})}
		p = plan.Plan{Steps: []plan.Step{{Tools: []plan.Tool{spawn, spawn}}, {AnswerTokens: 1}}}
		cancelAfter = m.CancelMin + time.Duration(rnd.Int64N(int64(m.CancelMax-m.CancelMin)+1))
	case Deadline:
		p = plan.Plan{TokensPerSecond: m.LongTokensPerSecond, Steps: []plan.Step{{AnswerTokens: longTokens}}}
		timeout = m.DeadlineTimeout
	}
	task, err := json.Marshal(p)
	if err != nil {
		panic(err) // plain structs: cannot fail
	}
	return &orchestratorv1.StartRunRequest{Task: string(task), Timeout: durationpb.New(timeout),
		IdempotencyKey: name}, cancelAfter
}

// toolsPlan is the Tools kind's plan.
func (m Mix) toolsPlan(name string, rnd *rand.Rand) plan.Plan {
	tools := []plan.Tool{
		{Name: plan.ToolSleep, Args: args(map[string]any{"ms": m.ToolMS})},
		{Name: plan.ToolKVPut, Args: args(map[string]any{"key": name, "value": 1}),
			IdempotencyKey: name + "/kv"},
	}
	if rnd.Float64() < m.ToolFailRate {
		tools = append(tools, plan.Tool{Name: plan.ToolFail})
	}
	return plan.Plan{TokensPerSecond: m.TokensPerSecond, Steps: []plan.Step{
		{ThinkTokens: m.StepTokens, Tools: tools},
		{AnswerTokens: m.StepTokens},
	}}
}

func args(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}
