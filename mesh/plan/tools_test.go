package plan_test

import (
	"errors"
	"strings"
	"testing"
	"time"

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

// spawn_subagent's arguments: a task or (for sim) a plan, never both, and the nested
// loop's run input; every refusal names the field.
func TestSpawnArgs(t *testing.T) {
	for _, ok := range []string{
		`{"task": "summarise the incident"}`,
		`{"task": "t", "model": "gpt-4o-mini", "tools": ["sleep", "github__search"], "max_tokens": 256, "reserve": "2s"}`,
		`{"task": "t", "reserve": "0.2"}`,
		`{"plan": {"steps": [{"answer_tokens": 1}]}, "reserve": "150ms"}`,
		`{"task": "{\"steps\": [{\"answer_tokens\": 1}]}", "model": "sim"}`,
	} {
		if err := plan.ValidateTool(plan.ToolSpawnSubagent, []byte(ok)); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
	for _, tc := range []struct{ args, path, msg string }{
		{`{}`, "args.task", "is required"},
		{`{"task": "  "}`, "args.task", "is required"},
		{`{"plan": null}`, "args.task", "is required"},
		{`{"task": "t", "plan": {"steps": [{"answer_tokens": 1}]}}`, "args.task", "either task or plan, not both"},
		{`{"task": 3}`, "args.task", "must be string"},
		{`{"task": "t", "model": "a b"}`, "args.model", "without spaces"},
		{`{"task": "t", "model": "` + strings.Repeat("m", plan.MaxModelNameLen+1) + `"}`, "args.model", "at most 128"},
		{`{"task": "t", "tools": "sleep"}`, "args.tools", "must be []string"},
		{`{"task": "t", "tools": ["sleep", ""]}`, "args.tools[1]", "a tool name"},
		{`{"task": "t", "tools": [` + strings.TrimSuffix(strings.Repeat(`"x",`, plan.MaxSpawnTools+1), ",") + `]}`, "args.tools", "at most 64 tools"},
		{`{"task": "t", "max_tokens": -1}`, "args.max_tokens", "between 0"},
		{`{"task": "t", "max_tokens": 1000001}`, "args.max_tokens", "and 1000000"},
		{`{"task": "t", "reserve": "soon"}`, "args.reserve", "a duration"},
		{`{"task": "t", "reserve": "1.5"}`, "args.reserve", "in (0, 1)"},
		{`{"task": "t", "reserve": "0"}`, "args.reserve", "in (0, 1)"},
		{`{"task": "t", "reserve": "-2s"}`, "args.reserve", "more than 0"},
		{`{"task": "t", "reserve": "2h"}`, "args.reserve", "at most 1h0m0s"},
		{`{"task": "t", "timeout": "2s"}`, "args", `unknown field "timeout"`},
	} {
		err := plan.ValidateTool(plan.ToolSpawnSubagent, []byte(tc.args))
		var pe *plan.Error
		if !errors.As(err, &pe) || pe.Path != tc.path || !strings.Contains(pe.Msg, tc.msg) {
			t.Errorf("%s: %v, want an error at %q containing %q", tc.args, err, tc.path, tc.msg)
		}
	}
}

// A reserve only ever shortens the caller's deadline.
func TestReserveDeadline(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	caller := now.Add(10 * time.Second)
	for _, tc := range []struct {
		reserve string
		want    time.Time
	}{
		{"", caller},
		{"2s", caller.Add(-2 * time.Second)},
		{"0.25", caller.Add(-2500 * time.Millisecond)},
		{"20s", caller.Add(-20 * time.Second)}, // more than is left: the child starts out of time
	} {
		r, err := plan.ParseReserve(tc.reserve)
		if err != nil {
			t.Fatalf("%q: %v", tc.reserve, err)
		}
		if got := r.Deadline(caller, now); !got.Equal(tc.want) {
			t.Errorf("reserve %q: deadline %v, want %v", tc.reserve, got, tc.want)
		}
	}
	// Past the caller's deadline a fraction of the (negative) time left is no reserve.
	r, _ := plan.ParseReserve("0.5")
	if got := r.Deadline(caller, caller.Add(time.Second)); !got.Equal(caller) {
		t.Errorf("past the deadline: %v, want the caller's %v", got, caller)
	}
}
