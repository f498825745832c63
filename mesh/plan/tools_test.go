package plan_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/plan"
)

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
}
