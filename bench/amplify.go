package bench

import (
	"encoding/json"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/curfew-mesh/curfew/mesh/plan"
)

// AmpTree is the run tree of the retry-amplification benchmark: Depth levels of subagents
// below the root, each loop spawning Fanout subagents in one step; the leaves are the
// model steps of the loops on level Depth. Every model step of every level fails each
// attempt with probability Rate (the step's model_error), and when FailTool is set every
// spawning step also calls the fail tool with the same rate beside its spawns, so that the
// loop → toolrunner hop of every level fails too.
type AmpTree struct {
	Depth      int
	Fanout     int
	Rate       float64
	FailTool   bool
	LeafTokens int     // tokens each leaf answers with
	TPS        float64 // decode rate of every level
	// LeafAlwaysFails makes every attempt of every leaf fail UNAVAILABLE (model_error
	// attempts 100, the most a plan allows): a probe of how many attempts one failing leaf
	// costs.
	LeafAlwaysFails bool
}

// Plan returns the root's plan.
func (t AmpTree) Plan() string {
	b, err := json.Marshal(t.level(0))
	if err != nil {
		panic(err)
	}
	return string(b)
}

type ampFault struct {
	Attempts int     `json:"attempts,omitempty"`
	Rate     float64 `json:"rate,omitempty"`
}

type ampStep struct {
	AnswerTokens int        `json:"answer_tokens,omitempty"`
	Tools        []toolJSON `json:"tools,omitempty"`
	ModelError   *ampFault  `json:"model_error,omitempty"`
}

type ampPlan struct {
	TokensPerSecond float64   `json:"tokens_per_second,omitempty"`
	Steps           []ampStep `json:"steps"`
}

func (t AmpTree) level(d int) ampPlan {
	var fault *ampFault
	if t.Rate > 0 {
		fault = &ampFault{Rate: t.Rate}
	}
	if d == t.Depth {
		if t.LeafAlwaysFails {
			fault = &ampFault{Attempts: 100}
		}
		return ampPlan{TokensPerSecond: t.TPS, Steps: []ampStep{{AnswerTokens: t.LeafTokens, ModelError: fault}}}
	}
	child := t.level(d + 1)
	tools := make([]toolJSON, 0, t.Fanout+1)
	for range t.Fanout {
		tools = append(tools, toolJSON{Name: plan.ToolSpawnSubagent, Args: map[string]any{"plan": child}})
	}
	if t.FailTool && t.Rate > 0 {
		tools = append(tools, toolJSON{Name: plan.ToolFail, Args: map[string]any{"rate": t.Rate}})
	}
	return ampPlan{TokensPerSecond: t.TPS, Steps: []ampStep{{Tools: tools, ModelError: fault}, {AnswerTokens: 1, ModelError: fault}}}
}

// Calls returns how many model calls, fail-tool calls and subagents a run of t makes when
// nothing fails, and how many of the model calls are leaves.
func (t AmpTree) Calls() (model, fail, subagents, leaves int) {
	loops := 1
	for d := 0; d < t.Depth; d++ {
		model += 2 * loops // the spawning step and the answer
		if t.FailTool && t.Rate > 0 {
			fail += loops
		}
		loops *= t.Fanout
		subagents += loops
	}
	return model + loops, fail, subagents, loops
}

// NodeDepth is the subagent level of a node id: the number of "/sub" segments in it
// ("root/m0" is 0, "root/s0.t1/sub/s0.t0/sub/m0" is 2).
func NodeDepth(id string) int {
	n := 0
	for _, seg := range strings.Split(id, "/") {
		if seg == "sub" {
			n++
		}
	}
	return n
}

// Wilson returns the Wilson score interval of k successes in n trials at z standard
// normal deviations (1.96 for 95 %).
func Wilson(k, n int, z float64) (lo, hi float64) {
	if n == 0 {
		return 0, 1
	}
	p := float64(k) / float64(n)
	nn := float64(n)
	den := 1 + z*z/nn
	mid := (p + z*z/(2*nn)) / den
	half := z / den * math.Sqrt(p*(1-p)/nn+z*z/(4*nn*nn))
	return max(0, mid-half), min(1, mid+half)
}

// Ints is a sample of counts.
type Ints []int

// Mean returns the arithmetic mean (0 when empty).
func (s Ints) Mean() float64 {
	if len(s) == 0 {
		return 0
	}
	sum := 0
	for _, v := range s {
		sum += v
	}
	return float64(sum) / float64(len(s))
}

// MeanCI returns the half-width of the normal-approximation confidence interval of the
// mean at z standard deviations.
func (s Ints) MeanCI(z float64) float64 {
	if len(s) < 2 {
		return math.NaN()
	}
	m := s.Mean()
	var ss float64
	for _, v := range s {
		ss += (float64(v) - m) * (float64(v) - m)
	}
	return z * math.Sqrt(ss/float64(len(s)-1)/float64(len(s)))
}

// Quantile is the nearest-rank q-quantile, as Dist.Quantile.
func (s Ints) Quantile(q float64) int {
	if len(s) == 0 {
		return 0
	}
	c := slices.Clone(s)
	slices.Sort(c)
	rank := min(max(int(math.Ceil(q*float64(len(c)))), 1), len(c))
	return c[rank-1]
}

// Max returns the largest value (0 when empty).
func (s Ints) Max() int {
	if len(s) == 0 {
		return 0
	}
	return slices.Max(s)
}

// Histogram counts the values: out[v] is how many samples equal v.
func (s Ints) Histogram() map[int]int {
	out := map[int]int{}
	for _, v := range s {
		out[v]++
	}
	return out
}

// PromSum sums every sample of metric name in a Prometheus text exposition whose labels
// include all of match (name="value" pairs; nil matches every sample).
func PromSum(exposition, name string, match map[string]string) float64 {
	var sum float64
	for _, line := range strings.Split(exposition, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		sp := strings.LastIndexByte(line, ' ')
		if sp < 0 {
			continue
		}
		key, val := line[:sp], line[sp+1:]
		metric, labels, _ := strings.Cut(key, "{")
		if metric != name {
			continue
		}
		labels = "," + labels
		ok := true
		for k, v := range match {
			if !strings.Contains(labels, ","+k+`="`+v+`"`) {
				ok = false
				break
			}
		}
		if !ok {
			continue
		}
		f, err := strconv.ParseFloat(val, 64)
		if err != nil {
			continue
		}
		sum += f
	}
	return sum
}

// NewcombeDiff returns the 95 % interval of p1 − p2 for two independent proportions k1/n1
// and k2/n2 by Newcombe's hybrid score method (from the two Wilson intervals).
func NewcombeDiff(k1, n1, k2, n2 int) (diff, lo, hi float64) {
	const z = 1.96
	p1, p2 := float64(k1)/float64(max(n1, 1)), float64(k2)/float64(max(n2, 1))
	l1, u1 := Wilson(k1, n1, z)
	l2, u2 := Wilson(k2, n2, z)
	diff = p1 - p2
	lo = diff - math.Sqrt((p1-l1)*(p1-l1)+(u2-p2)*(u2-p2))
	hi = diff + math.Sqrt((u1-p1)*(u1-p1)+(p2-l2)*(p2-l2))
	return diff, lo, hi
}
