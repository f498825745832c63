package soak

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/plan"
)

// Every kind's request is a plan the orchestrator accepts, named apart by its name, and
// only the Cancelled kind is cancelled by its client, within its window.
func TestMixRequestsAreValidPlans(t *testing.T) {
	m := DefaultMix()
	m.MCPTool = "fx__effect"
	rnd := rand.New(rand.NewPCG(1, 2))
	for _, k := range []Kind{Tools, MCP, Subagent, Failing, Cancelled, Deadline} {
		req, cancelAfter := m.request(k, "soak-x-1", rnd)
		if _, err := plan.Parse([]byte(req.GetTask())); err != nil {
			t.Errorf("%s: the plan does not parse: %v\n%s", k, err, req.GetTask())
		}
		if req.GetIdempotencyKey() != "soak-x-1" {
			t.Errorf("%s: idempotency key %q, want the run's name", k, req.GetIdempotencyKey())
		}
		switch {
		case k == Cancelled && (cancelAfter < m.CancelMin || cancelAfter > m.CancelMax):
			t.Errorf("cancelled after %v, want within [%v, %v]", cancelAfter, m.CancelMin, m.CancelMax)
		case k != Cancelled && cancelAfter != 0:
			t.Errorf("%s: cancelled after %v, want never", k, cancelAfter)
		}
		want := m.Timeout
		if k == Deadline {
			want = m.DeadlineTimeout
		}
		if got := req.GetTimeout().AsDuration(); got != want {
			t.Errorf("%s: timeout %v, want %v", k, got, want)
		}
	}
	if req, _ := m.request(MCP, "soak-x-2", rnd); !strings.Contains(req.GetTask(), `"soak-x-2/mcp"`) {
		t.Errorf("the MCP call's idempotency key is not the run's: %s", req.GetTask())
	}
}

// Kinds are drawn by weight; a kind of weight 0, and MCP without a tool, never.
func TestMixPicksByWeight(t *testing.T) {
	m := DefaultMix()
	m.Weights = map[Kind]int{Tools: 3, Cancelled: 1, Deadline: 0, MCP: 5}
	rnd := rand.New(rand.NewPCG(3, 4))
	n := map[Kind]int{}
	for range 4000 {
		n[m.pick(rnd)]++
	}
	if n[Deadline] != 0 || n[MCP] != 0 {
		t.Fatalf("drawn %v: a kind of weight 0 or MCP without a tool", n)
	}
	if ratio := float64(n[Tools]) / float64(n[Cancelled]); ratio < 2.5 || ratio > 3.5 {
		t.Fatalf("tools:cancelled = %.2f (%v), want about 3", ratio, n)
	}
}

func TestMixValidate(t *testing.T) {
	for name, change := range map[string]func(*Mix){
		"unknown kind":       func(m *Mix) { m.Weights = map[Kind]int{"nap": 1} },
		"negative weight":    func(m *Mix) { m.Weights[Tools] = -1 },
		"nothing to run":     func(m *Mix) { m.Weights = map[Kind]int{MCP: 1} },
		"no decode rate":     func(m *Mix) { m.TokensPerSecond = 0 },
		"cancel window":      func(m *Mix) { m.CancelMax = m.CancelMin - time.Millisecond },
		"deadline ≥ timeout": func(m *Mix) { m.DeadlineTimeout = m.Timeout },
		"fail rate":          func(m *Mix) { m.ToolFailRate = 1.5 },
	} {
		m := DefaultMix()
		change(&m)
		if err := m.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %+v", name, m)
		}
	}
	if err := DefaultMix().Validate(); err != nil {
		t.Fatalf("the default mix: %v", err)
	}
}
