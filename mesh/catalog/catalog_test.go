package catalog_test

import (
	"encoding/json"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

func TestIsBuiltin(t *testing.T) {
	for _, n := range []string{plan.ToolSleep, plan.ToolSpawnSubagent, plan.ToolDeploy, plan.ToolFail} {
		if !catalog.IsBuiltin(n) {
			t.Errorf("IsBuiltin(%q) = false", n)
		}
	}
	for _, n := range []string{"", "Sleep", "mcp.search"} {
		if catalog.IsBuiltin(n) {
			t.Errorf("IsBuiltin(%q) = true", n)
		}
	}
}

// Every built-in tool a model is told about has a schema that is a JSON object schema,
// and the example arguments it describes pass ValidateTool.
func TestToolSpecs(t *testing.T) {
	examples := map[string]string{
		plan.ToolSleep:         `{"ms": 5, "progress_ms": 10}`,
		plan.ToolDeploy:        `{"duration_ms": 10, "poll_ms": 1}`,
		plan.ToolSpawnSubagent: `{"task": "check the deploy", "model": "gpt-4o-mini", "tools": ["sleep"], "max_tokens": 512, "reserve": "2s"}`,
		plan.ToolKVPut:         `{"key": "release", "value": {"version": 3}}`,
		plan.ToolNotify:        `{"channel": "ops", "message": "deployed"}`,
	}
	specs := catalog.Specs()
	if len(specs) != len(examples) {
		t.Fatalf("%d specs, want %d", len(specs), len(examples))
	}
	for _, s := range specs {
		var schema map[string]any
		if err := json.Unmarshal([]byte(s.GetParametersJson()), &schema); err != nil || schema["type"] != "object" {
			t.Errorf("%s: parameters %s: %v", s.GetName(), s.GetParametersJson(), err)
		}
		if !catalog.IsBuiltin(s.GetName()) || s.GetDescription() == "" {
			t.Errorf("%s: not a described built-in", s.GetName())
		}
		if err := plan.ValidateTool(s.GetName(), []byte(examples[s.GetName()])); err != nil {
			t.Errorf("%s: example rejected: %v", s.GetName(), err)
		}
	}
}

func TestDurableTools(t *testing.T) {
	for _, n := range []string{plan.ToolKVPut, plan.ToolNotify} {
		// Keyed by toolrunner itself: retried freely, unlike deploy.
		if !catalog.Durable(n) || catalog.NeedsKey(n) || !catalog.IsBuiltin(n) {
			t.Errorf("%s: durable %v, retried only with a key %v, built-in %v", n, catalog.Durable(n), catalog.NeedsKey(n), catalog.IsBuiltin(n))
		}
	}
	if !catalog.NeedsKey(plan.ToolDeploy) {
		t.Error("deploy is retried only with a key")
	}
	if catalog.Durable(plan.ToolDeploy) {
		t.Error("deploy is not kept in the store")
	}
}

// The catalogue: each built-in's side effects, durability, and whether models are told
// of it, in the order they are told.
func TestBuiltins(t *testing.T) {
	want := []struct {
		tool    catalog.Tool // Spec unset; offered says whether it has one
		offered bool
	}{
		{catalog.Tool{Name: plan.ToolSleep, SideEffects: catalog.None}, true},
		{catalog.Tool{Name: plan.ToolDeploy, SideEffects: catalog.Irreversible}, true},
		{catalog.Tool{Name: plan.ToolKVPut, SideEffects: catalog.Idempotent, Durable: true}, true},
		{catalog.Tool{Name: plan.ToolNotify, SideEffects: catalog.Irreversible, Durable: true}, true},
		{catalog.Tool{Name: plan.ToolSpawnSubagent, SideEffects: catalog.None}, true},
		{catalog.Tool{Name: plan.ToolFail, SideEffects: catalog.None}, false},
	}
	got := catalog.Builtins()
	if len(got) != len(want) {
		t.Fatalf("%d built-ins, want %d", len(got), len(want))
	}
	var offered []string
	for i, w := range want {
		g := got[i]
		if g.Name != w.tool.Name || g.SideEffects != w.tool.SideEffects || g.Durable != w.tool.Durable || (g.Spec != nil) != w.offered {
			t.Errorf("built-in %d = %s (%v, durable %v, spec %v), want %s (%v, durable %v, offered %v)",
				i, g.Name, g.SideEffects, g.Durable, g.Spec != nil, w.tool.Name, w.tool.SideEffects, w.tool.Durable, w.offered)
		}
		if g.Spec != nil {
			if g.Spec.GetName() != g.Name {
				t.Errorf("%s: spec named %q", g.Name, g.Spec.GetName())
			}
			offered = append(offered, g.Name)
		}
	}
	for i, s := range catalog.Specs() {
		if i >= len(offered) || s.GetName() != offered[i] {
			t.Errorf("Specs()[%d] = %s, want the offered built-ins in order %v", i, s.GetName(), offered)
		}
	}
	// Each call returns values of its own: a caller changing a spec changes no other's.
	got[0].Spec.Description = "changed"
	if catalog.Builtins()[0].Spec.GetDescription() == "changed" || catalog.Specs()[0].GetDescription() == "changed" {
		t.Error("Builtins shares its specs between calls")
	}
}

func TestNeedsKey(t *testing.T) {
	for _, tc := range []struct {
		tool catalog.Tool
		want bool
	}{
		{catalog.Tool{}, true}, // the zero value says nothing, so it is taken to be irreversible
		{catalog.Tool{SideEffects: catalog.Irreversible}, true},
		{catalog.Tool{SideEffects: catalog.Irreversible, Durable: true}, false},
		{catalog.Tool{SideEffects: catalog.Idempotent}, false},
		{catalog.Tool{SideEffects: catalog.None}, false},
	} {
		if got := tc.tool.NeedsKey(); got != tc.want {
			t.Errorf("%+v.NeedsKey() = %v, want %v", tc.tool, got, tc.want)
		}
	}
	for _, n := range []string{plan.ToolSleep, plan.ToolFail, plan.ToolSpawnSubagent} {
		if catalog.NeedsKey(n) {
			t.Errorf("NeedsKey(%q) = true", n)
		}
	}
	// A name that is not a built-in's is a tool source's, of effects unknown here.
	for _, n := range []string{"", "mcp.search", "github__create_issue"} {
		if !catalog.NeedsKey(n) {
			t.Errorf("NeedsKey(%q) = false, want true for a tool that is not a built-in", n)
		}
	}
}

func TestSideEffectsString(t *testing.T) {
	for e, want := range map[catalog.SideEffects]string{
		catalog.Irreversible: "irreversible", catalog.Idempotent: "idempotent", catalog.None: "none", 7: "SideEffects(7)",
	} {
		if got := e.String(); got != want {
			t.Errorf("%d.String() = %q, want %q", uint8(e), got, want)
		}
	}
}
