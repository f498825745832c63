package plan_test

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/plan"
)

func TestIsBuiltin(t *testing.T) {
	for _, n := range []string{plan.ToolSleep, plan.ToolSpawnSubagent, plan.ToolDeploy, plan.ToolFail} {
		if !plan.IsBuiltin(n) {
			t.Errorf("IsBuiltin(%q) = false", n)
		}
	}
	for _, n := range []string{"", "Sleep", "mcp.search"} {
		if plan.IsBuiltin(n) {
			t.Errorf("IsBuiltin(%q) = true", n)
		}
	}
}

func TestValidateTool(t *testing.T) {
	if err := plan.ValidateTool("sleep", []byte(`{"ms":5}`)); err != nil {
		t.Errorf("valid sleep: %v", err)
	}
	if err := plan.ValidateTool("fail", nil); err != nil {
		t.Errorf("fail without args: %v", err)
	}
	cases := []struct{ name, args, path string }{
		{"sleep", `{"ms":0}`, "args.ms"},
		{"sleep", `{"ms":1,"x":1}`, "args"},
		{"fail", `{"code":"NOPE"}`, "args.code"},
		{"deploy", `{}`, "args.duration_ms"},
		{"spawn_subagent", `{"plan":{"steps":[{"think_tokens":1}]}}`, "args.plan.steps[0].answer_tokens"},
		{"nope", `{}`, "name"},
		{"", `{}`, "name"},
	}
	for _, tc := range cases {
		err := plan.ValidateTool(tc.name, []byte(tc.args))
		var pe *plan.Error
		if !errors.As(err, &pe) || pe.Path != tc.path {
			t.Errorf("ValidateTool(%q, %s) = %v, want an error at %q", tc.name, tc.args, err, tc.path)
		}
	}
}

// Every built-in tool a model is told about has a schema that is a JSON object schema,
// and the example arguments it describes pass ValidateTool.
func TestToolSpecs(t *testing.T) {
	examples := map[string]string{
		plan.ToolSleep:         `{"ms": 5}`,
		plan.ToolDeploy:        `{"duration_ms": 10, "poll_ms": 1}`,
		plan.ToolSpawnSubagent: `{"plan": {"steps": [{"answer_tokens": 1}]}}`,
		plan.ToolKVPut:         `{"key": "release", "value": {"version": 3}}`,
		plan.ToolNotify:        `{"channel": "ops", "message": "deployed"}`,
	}
	specs := plan.ToolSpecs()
	if len(specs) != len(examples) {
		t.Fatalf("%d specs, want %d", len(specs), len(examples))
	}
	for _, s := range specs {
		var schema map[string]any
		if err := json.Unmarshal([]byte(s.GetParametersJson()), &schema); err != nil || schema["type"] != "object" {
			t.Errorf("%s: parameters %s: %v", s.GetName(), s.GetParametersJson(), err)
		}
		if !plan.IsBuiltin(s.GetName()) || s.GetDescription() == "" {
			t.Errorf("%s: not a described built-in", s.GetName())
		}
		if err := plan.ValidateTool(s.GetName(), []byte(examples[s.GetName()])); err != nil {
			t.Errorf("%s: example rejected: %v", s.GetName(), err)
		}
	}
}

func TestDurableToolArgs(t *testing.T) {
	for _, tc := range []struct{ name, args, want string }{
		{plan.ToolKVPut, `{"value": 1}`, "args.key"},
		{plan.ToolKVPut, `{"key": "a"}`, "args.value"},
		{plan.ToolKVPut, `{"key": "a\n", "value": 1}`, "args.key"},
		{plan.ToolKVPut, `{"key": "a", "value": 1, "extra": 2}`, "extra"},
		{plan.ToolNotify, `{"message": "x"}`, "args.channel"},
		{plan.ToolNotify, `{"channel": "c", "grace_ms": -1}`, "args.grace_ms"},
	} {
		err := plan.ValidateTool(tc.name, []byte(tc.args))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %s: %v, want an error naming %s", tc.name, tc.args, err, tc.want)
		}
	}
	for _, n := range []string{plan.ToolKVPut, plan.ToolNotify} {
		// Keyed by toolrunner itself: retried freely, unlike deploy.
		if !plan.Durable(n) || plan.SideEffects(n) || !plan.IsBuiltin(n) {
			t.Errorf("%s: durable %v, retried only with a key %v, built-in %v", n, plan.Durable(n), plan.SideEffects(n), plan.IsBuiltin(n))
		}
	}
	if !plan.SideEffects(plan.ToolDeploy) {
		t.Error("deploy is retried only with a key")
	}
	if plan.Durable(plan.ToolDeploy) {
		t.Error("deploy is not kept in the store")
	}
}
