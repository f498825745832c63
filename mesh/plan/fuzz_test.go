package plan_test

import (
	"testing"

	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// FuzzValidateTool (FuzzParse is in plan_test.go): a model (a real one, not only the sim) chooses tool names and
// arguments; validation must never panic on them.
func FuzzValidateTool(f *testing.F) {
	for _, s := range []struct{ name, args string }{
		{"sleep", `{"ms": 5}`}, {"fail", `{"times": 2, "code": "UNAVAILABLE", "pushback_ms": -1}`},
		{"deploy", `{"duration_ms": 10, "poll_ms": 1}`}, {"kv_put", `{"key": "k", "value": 1}`},
		{"notify", `{"channel": "c", "message": "m", "grace_ms": 5}`}, {"spawn_subagent", `{"plan": {"steps": [{"answer_tokens": 1}]}}`},
		{"nope", `{}`}, {"github__search", `{"q": "x"}`}, {"github__search", `[1]`}, {"sleep", `{"ms": -1}`}, {"fail", `{"rate": 2}`}, {"kv_put", `null`}, {"notify", ``},
	} {
		f.Add(s.name, []byte(s.args))
	}
	f.Fuzz(func(t *testing.T, name string, args []byte) {
		err := plan.ValidateTool(name, args)
		if err == nil && !catalog.IsBuiltin(name) && !plan.IsSourceTool(name) {
			t.Fatalf("accepted unknown tool %q", name)
		}
	})
}
