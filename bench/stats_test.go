package bench

import (
	"encoding/json"
	"os"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/plan"
)

func TestQuantileNearestRank(t *testing.T) {
	var d Dist
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(101-i)*time.Millisecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 50 * time.Millisecond}, {0.9, 90 * time.Millisecond}, {0.99, 99 * time.Millisecond}, {1, 100 * time.Millisecond}, {0.001, time.Millisecond}} {
		if got := d.Quantile(c.q); got != c.want {
			t.Errorf("Quantile(%v) = %v, want %v", c.q, got, c.want)
		}
	}
	if got := d[:40].Quantile(0.99); got != d[:40].Max() {
		t.Errorf("p99 of 40 samples = %v, want the maximum %v", got, d[:40].Max())
	}
	if (Dist{}).Quantile(0.5) != 0 {
		t.Error("empty Dist")
	}
}

// Every benchmarked tree must pass the orchestrator's own validation and have the leaves
// and depth it claims.
func TestShapesAreValidPlans(t *testing.T) {
	for _, s := range Shapes {
		p, err := plan.Parse([]byte(TreePlan(s, leafTokens, leafTPS)))
		if err != nil {
			t.Fatalf("%s: %v", s.Name(), err)
		}
		leaves, depth := countLeaves(t, p, 0)
		if leaves != s.Leaves || depth != s.Depth || len(s.Fanouts) != s.Depth {
			t.Errorf("%s: plan has %d leaves at depth %d", s.Name(), leaves, depth)
		}
		if s.Subagents() > cancelFanout {
			t.Errorf("%s: %d subagents exceed the fan-out limit the benchmark sets (%d)", s.Name(), s.Subagents(), cancelFanout)
		}
	}
	if _, err := plan.Parse([]byte(SleepPlan(memorySleepMS))); err != nil {
		t.Fatal(err)
	}
}

func countLeaves(t *testing.T, p *plan.Plan, depth int) (leaves, leafDepth int) {
	first := p.Steps[0]
	if len(first.Tools) == 0 {
		if first.AnswerTokens != leafTokens || p.TPS() != leafTPS {
			t.Errorf("leaf at depth %d decodes %d tokens at %v/s", depth, first.AnswerTokens, p.TPS())
		}
		return 1, depth
	}
	for _, tool := range first.Tools {
		var a plan.SpawnArgs
		if err := json.Unmarshal(tool.Args, &a); err != nil {
			t.Fatal(err)
		}
		child, err := plan.Parse(a.Plan)
		if err != nil {
			t.Fatal(err)
		}
		n, d := countLeaves(t, child, depth+1)
		leaves += n
		leafDepth = d
	}
	return leaves, leafDepth
}

func TestReadMemoryAndCPUOfSelf(t *testing.T) {
	m, err := ReadMemory(os.Getpid())
	if err != nil {
		t.Skip("no /proc/<pid>/smaps_rollup here: ", err)
	}
	if m.RSS <= 0 || m.PSS <= 0 {
		t.Errorf("memory %+v", m)
	}
	if c, err := CPUTime(os.Getpid()); err != nil || c <= 0 {
		t.Errorf("CPUTime = %v, %v", c, err)
	}
}

func TestPromValue(t *testing.T) {
	text := "# HELP go_goroutines x\n# TYPE go_goroutines gauge\ngo_goroutines 42\ngo_goroutines_total{a=\"b\"} 7\ngo_memstats_heap_inuse_bytes 1.2e+06\n"
	if v, ok := PromValue(text, "go_goroutines"); !ok || v != 42 {
		t.Errorf("go_goroutines = %v, %v", v, ok)
	}
	if v, ok := PromValue(text, "go_memstats_heap_inuse_bytes"); !ok || v != 1.2e6 {
		t.Errorf("heap = %v, %v", v, ok)
	}
	if _, ok := PromValue(text, "missing"); ok {
		t.Error("missing metric found")
	}
}
