package soak

import (
	"fmt"
	"sort"
	"strings"
)

// Summary is the report in a few lines for people: the load, its outcomes, latencies,
// capacity figures and checks.
func (r *Report) Summary() string {
	var b strings.Builder
	fmt.Fprintf(&b, "load: %d runs in flight for %s (seed %d); %d runs started, %d refused at start\n",
		r.Concurrency, r.Duration, r.Seed, r.Runs, sum(r.Refused))
	fmt.Fprintf(&b, "mix: %s; model steps of %d tokens at %.0f tokens/s, tools of %d ms, %.0f %% of tools runs with a failing tool\n",
		weights(r.Mix.Weights), r.Mix.StepTokens, r.Mix.TokensPerSecond, r.Mix.ToolMS, 100*r.Mix.ToolFailRate)
	fmt.Fprintf(&b, "throughput: %.1f runs/s; %.1f runs per CPU-second of all processes\n", r.Throughput, r.RunsPerCoreSecond)
	fmt.Fprintf(&b, "outcomes: %s\n", counts(r.Outcomes))
	if len(r.Refused) > 0 {
		fmt.Fprintf(&b, "refused at start: %s\n", counts(r.Refused))
	}
	pct := func(name string, p Percentiles) {
		fmt.Fprintf(&b, "%-28s n=%-6d p50 %8.1f ms  p90 %8.1f ms  p99 %8.1f ms  max %8.1f ms\n", name, p.N, p.P50, p.P90, p.P99, p.Max)
	}
	pct("start (StartRun)", r.StartLatency)
	kinds := make([]string, 0, len(r.Kinds))
	for k := range r.Kinds {
		kinds = append(kinds, string(k))
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		pct("run "+k, r.Kinds[Kind(k)].Latency)
	}
	pct("cancel to last decoder", r.CancelLatency)
	pct("deadline overshoot", r.DeadlineOvershoot)
	fmt.Fprintf(&b, "tokens after a cancel: %d in all, at most %d per decoder\n", r.OrphanTokens, r.MaxOrphanPerDecoder)
	for i, d := range r.OverOne {
		if i == 10 {
			fmt.Fprintf(&b, "  ... %d more in report.json\n", len(r.OverOne)-i)
			break
		}
		fmt.Fprintf(&b, "  %s %s (%s): %d tokens, cancel at %.1f s, last decoder %.1f ms after it\n", d.Run, d.Node, d.Kind, d.Tokens, d.At, d.CancelToLast)
	}
	if r.Effects != nil {
		fmt.Fprintf(&b, "MCP effects: %d calls, %d happened more than once\n", r.Effects.Calls, r.Effects.Duplicates)
	}
	fmt.Fprintf(&b, "%-14s %10s %10s %12s %12s %10s\n", "process", "goroutines", "(before)", "heap MiB", "(before)", "CPU s")
	before := map[string]Sample{}
	for _, s := range r.Baseline {
		before[s.Process] = s
	}
	for _, s := range r.After {
		bs := before[s.Process]
		fmt.Fprintf(&b, "%-14s %10.0f %10.0f %12.1f %12.1f %10.1f\n", s.Process, s.Goroutines, bs.Goroutines,
			s.HeapInuse/(1<<20), bs.HeapInuse/(1<<20), r.CPUSeconds[s.Process])
	}
	for _, c := range r.Checks {
		mark := "ok  "
		if !c.OK {
			mark = "FAIL"
		}
		fmt.Fprintf(&b, "%s %s: %s\n", mark, c.Name, c.Detail)
	}
	return b.String()
}

func sum(m map[string]int) int {
	n := 0
	for _, v := range m {
		n += v
	}
	return n
}

func counts(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	return strings.Join(parts, ", ")
}

func weights(w map[Kind]int) string {
	m := map[string]int{}
	for k, v := range w {
		m[string(k)] = v
	}
	return counts(m)
}
