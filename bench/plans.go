package bench

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/curfew-mesh/curfew/mesh/plan"
)

// Shape is a run tree for the cancel-propagation benchmark.
//
// Depth is how many levels of subagents lie between the root run and the leaf decoders:
// at depth 0 the leaf is the root loop's own model step; at depth d the leaves are the
// first model step of the subagents on level d, and every level above only spawns.
// Fanouts[i] is how many subagents each loop on level i spawns in one step (level 0 is
// the root), so Leaves is their product and len(Fanouts) == Depth.
//
// A loop runs one model step at a time, so each concurrent decoder needs a loop of its
// own, and one step calls at most plan.MaxToolsPerStep (16) tools: 64 leaves therefore
// need depth >= 2.
type Shape struct {
	Leaves  int
	Depth   int
	Fanouts []int
}

// Name is the sub-benchmark name, for example "leaves=64/depth=2".
func (s Shape) Name() string { return fmt.Sprintf("leaves=%d/depth=%d", s.Leaves, s.Depth) }

// Desc spells the tree, for example "root → 8 sub → 8 sub each".
func (s Shape) Desc() string {
	if s.Depth == 0 {
		return "root's own model step"
	}
	parts := make([]string, len(s.Fanouts))
	for i, f := range s.Fanouts {
		parts[i] = fmt.Sprint(f)
	}
	return strings.Join(parts, " × ") + " subagents"
}

// Subagents is how many subagents the tree holds in flight.
func (s Shape) Subagents() int {
	n, level := 0, 1
	for _, f := range s.Fanouts {
		level *= f
		n += level
	}
	return n
}

// Shapes are the benchmarked trees. Leaves=64 at depth 1 is impossible (see Shape).
var Shapes = []Shape{
	{1, 0, nil},
	{1, 1, []int{1}},
	{1, 2, []int{1, 1}},
	{1, 3, []int{1, 1, 1}},
	{8, 1, []int{8}},
	{8, 2, []int{2, 4}},
	{8, 3, []int{2, 2, 2}},
	{64, 2, []int{8, 8}},
	{64, 3, []int{4, 4, 4}},
}

type planJSON struct {
	TokensPerSecond float64    `json:"tokens_per_second,omitempty"`
	Steps           []stepJSON `json:"steps"`
}

type stepJSON struct {
	ThinkTokens  int        `json:"think_tokens,omitempty"`
	AnswerTokens int        `json:"answer_tokens,omitempty"`
	Tools        []toolJSON `json:"tools,omitempty"`
}

type toolJSON struct {
	Name string `json:"name"`
	Args any    `json:"args,omitempty"`
}

// TreePlan returns the plan of shape s whose leaves decode leafTokens at tps tokens per
// second. Spawning levels think for 0 tokens, so their model steps end at once and call
// their tools.
func TreePlan(s Shape, leafTokens int, tps float64) string {
	b, err := json.Marshal(treePlan(s.Fanouts, leafTokens, tps))
	if err != nil {
		panic(err)
	}
	return string(b)
}

func treePlan(fanouts []int, leafTokens int, tps float64) planJSON {
	if len(fanouts) == 0 {
		return planJSON{TokensPerSecond: tps, Steps: []stepJSON{{AnswerTokens: leafTokens}}}
	}
	child := treePlan(fanouts[1:], leafTokens, tps)
	tools := make([]toolJSON, fanouts[0])
	for i := range tools {
		tools[i] = toolJSON{Name: plan.ToolSpawnSubagent, Args: map[string]any{"plan": child}}
	}
	return planJSON{Steps: []stepJSON{{Tools: tools}, {AnswerTokens: 1}}}
}

// SleepPlan is a run that waits ms on the sleep tool, then answers with one token.
func SleepPlan(ms int) string {
	b, err := json.Marshal(planJSON{Steps: []stepJSON{
		{Tools: []toolJSON{{Name: plan.ToolSleep, Args: map[string]int{"ms": ms}}}},
		{AnswerTokens: 1},
	}})
	if err != nil {
		panic(err)
	}
	return string(b)
}

// SmallPlan is the throughput benchmark's run: a model step of 50 tokens that calls two
// 1 ms sleep tools in parallel, then an answer of 50 tokens, decoded at 10,000 tokens/s
// (issue 26's "small plan": 2 model steps, 2 tools).
func SmallPlan() string {
	sleep := toolJSON{Name: plan.ToolSleep, Args: map[string]int{"ms": 1}}
	b, err := json.Marshal(planJSON{TokensPerSecond: 10000, Steps: []stepJSON{
		{ThinkTokens: 50, Tools: []toolJSON{sleep, sleep}},
		{AnswerTokens: 50},
	}})
	if err != nil {
		panic(err)
	}
	return string(b)
}
