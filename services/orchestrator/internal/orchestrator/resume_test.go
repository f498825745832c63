package orchestrator

import (
	"testing"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/plan"
	"github.com/curfew-mesh/curfew/mesh/toollist"
)

// A step stopped after its model output may run again when each of its tool calls may:
// a built-in by the catalogue, a source's tool by its listed side effects (none and
// idempotent freely, irreversible only with a key), a tool of unknown effects (not
// listed, or toolrunner did not list) only with a key.
func TestSafeToResumeByListedSideEffects(t *testing.T) {
	listed := toollist.FromResponse(&toolrunnerv1.ListToolsResponse{Tools: []*toolrunnerv1.ToolInfo{
		{Name: "team__read", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE},
		{Name: "team__put", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT},
		{Name: "team__send", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE},
		{Name: "team__what"},
	}})
	step := func(calls ...*modelproxyv1.ToolCall) []agent.Entry {
		return []agent.Entry{{Step: 0, Kind: agent.EntryModel, ToolCalls: calls}}
	}
	c := func(name, key string) *modelproxyv1.ToolCall {
		return &modelproxyv1.ToolCall{Name: name, IdempotencyKey: key}
	}
	for _, tc := range []struct {
		name    string
		entries []agent.Entry
		tools   *toollist.Tools
		want    bool
	}{
		{"none", step(c("team__read", "")), listed, true},
		{"idempotent", step(c("team__put", ""), c(plan.ToolSleep, "")), listed, true},
		{"irreversible", step(c("team__read", ""), c("team__send", "")), listed, false},
		{"irreversible with a key", step(c("team__send", "k")), listed, true},
		{"unspecified", step(c("team__what", "")), listed, false},
		{"not listed", step(c("team__gone", "")), listed, false},
		{"toolrunner did not list", step(c("team__read", "")), toollist.Builtins(), false},
		{"deploy", step(c(plan.ToolDeploy, "")), listed, false},
		{"notify (durable)", step(c(plan.ToolNotify, "")), toollist.Builtins(), true},
		{"tools done", append(step(c("team__send", "")), agent.Entry{Step: 0, Kind: agent.EntryTools}), listed, true},
	} {
		if got := safeToResume(tc.entries, tc.tools); got != tc.want {
			t.Errorf("%s: safeToResume = %v, want %v", tc.name, got, tc.want)
		}
	}
}
