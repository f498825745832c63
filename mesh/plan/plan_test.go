package plan_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"

	"github.com/curfew-mesh/curfew/mesh/plan"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// designExample is the plan of DESIGN.md.
const designExample = `{"tokens_per_second": 40,
 "steps": [
   {"think_tokens": 120,
    "tools": [{"name": "sleep", "args": {"ms": 2000}},
              {"name": "spawn_subagent", "args": {"plan": {"steps": [{"think_tokens": 400}, {"answer_tokens": 50}]}}}]},
   {"answer_tokens": 80}]}`

var validPlans = map[string]string{
	"design example": designExample,
	"answer only":    `{"steps":[{"answer_tokens":1}]}`,
	"think only":     `{"steps":[{"think_tokens":3},{"think_tokens":3,"tools":[{"name":"sleep","args":{"ms":1}}]},{"answer_tokens":3}]}`,
	"sleep progress": `{"steps":[{"tools":[{"name":"sleep","args":{"ms":600,"progress_ms":100}},{"name":"sleep","args":{"ms":5,"progress_ms":0}}]},{"answer_tokens":1}]}`,
	"faults": `{"tokens_per_second": 1000, "steps":[
		{"think_tokens":10,"first_token_delay_ms":500,"model_error":{"attempts":2,"code":"unavailable"},
		 "tools":[{"name":"fail","args":{"times":2,"code":"RESOURCE_EXHAUSTED","after_ms":10}},
		          {"name":"deploy","args":{"duration_ms":3000,"poll_ms":100,"abort_ms":200,"cleanup_ms":1000}},
		          {"name":"fail"}]},
		{"answer_tokens":5,"model_error":{"attempts":1}}]}`,
	"max nesting":    nest(plan.MaxDepth),
	"max tool calls": wide((plan.MaxToolCalls - plan.MaxToolsPerStep) / plan.MaxToolsPerStep),
}

// nest returns a valid plan whose spawn_subagent plans nest depth levels deep.
// wide returns a plan whose first step spawns 16 subagents, each of whose plans calls
// perSub sleeps (16 per step): 16 + 16 × perSub tool calls in all.
func wide(perSub int) string {
	sleeps := func(n int) string {
		return strings.TrimSuffix(strings.Repeat(`{"name":"sleep","args":{"ms":1}},`, n), ",")
	}
	var steps []string
	for n := perSub; n > 0; n -= plan.MaxToolsPerStep {
		steps = append(steps, fmt.Sprintf(`{"tools":[%s]}`, sleeps(min(n, plan.MaxToolsPerStep))))
	}
	sub := fmt.Sprintf(`{"steps":[%s,{"answer_tokens":1}]}`, strings.Join(steps, ","))
	spawn := strings.TrimSuffix(strings.Repeat(`{"name":"spawn_subagent","args":{"plan":`+sub+`}},`, plan.MaxToolsPerStep), ",")
	return fmt.Sprintf(`{"steps":[{"tools":[%s]},{"answer_tokens":1}]}`, spawn)
}

func nest(depth int) string {
	p := `{"steps":[{"answer_tokens":1}]}`
	for range depth {
		p = fmt.Sprintf(`{"steps":[{"tools":[{"name":"spawn_subagent","args":{"plan":%s}}]},{"answer_tokens":1}]}`, p)
	}
	return p
}

func TestParseValid(t *testing.T) {
	for name, src := range validPlans {
		t.Run(name, func(t *testing.T) {
			p, err := plan.Parse([]byte(src))
			if err != nil {
				t.Fatal(err)
			}
			last := p.Steps[len(p.Steps)-1]
			if last.AnswerTokens == 0 || len(last.Tools) != 0 {
				t.Errorf("last step %+v does not answer", last)
			}
		})
	}
}

func TestParseDesignExample(t *testing.T) {
	p, err := plan.Parse([]byte(designExample))
	if err != nil {
		t.Fatal(err)
	}
	if p.TPS() != 40 || len(p.Steps) != 2 || p.Steps[0].ThinkTokens != 120 || p.Steps[1].AnswerTokens != 80 {
		t.Fatalf("parsed %+v", p)
	}
	tools := p.Steps[0].Tools
	if len(tools) != 2 || tools[0].Name != plan.ToolSleep || tools[1].Name != plan.ToolSpawnSubagent {
		t.Fatalf("tools = %+v", tools)
	}
	var sleep plan.SleepArgs
	if err := plan.Args(tools[0].Args, &sleep); err != nil || sleep.MS != 2000 {
		t.Errorf("sleep args = %+v, %v", sleep, err)
	}
	var spawn plan.SpawnArgs
	if err := plan.Args(tools[1].Args, &spawn); err != nil {
		t.Fatal(err)
	}
	sub, err := plan.Parse(spawn.Plan)
	if err != nil {
		t.Fatal(err)
	}
	if len(sub.Steps) != 2 || sub.Steps[0].ThinkTokens != 400 || sub.Steps[1].AnswerTokens != 50 || sub.TPS() != plan.DefaultTokensPerSecond {
		t.Errorf("nested plan = %+v", sub)
	}
}

func TestTPSDefault(t *testing.T) {
	p, err := plan.Parse([]byte(`{"steps":[{"answer_tokens":3}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if p.TPS() != 40 || plan.DefaultTokensPerSecond != 40 {
		t.Errorf("TPS() = %v, want 40", p.TPS())
	}
	p, _ = plan.Parse([]byte(`{"tokens_per_second":2.5,"steps":[{"answer_tokens":3}]}`))
	if p.TPS() != 2.5 {
		t.Errorf("TPS() = %v, want 2.5", p.TPS())
	}
}

func TestParseInvalid(t *testing.T) {
	sleep := func(args string) string {
		return fmt.Sprintf(`{"steps":[{"think_tokens":1,"tools":[{"name":"sleep","args":{"ms":5}},{"name":"sleep","args":%s}]},{"answer_tokens":1}]}`, args)
	}
	tool := func(t string) string {
		return fmt.Sprintf(`{"steps":[{"tools":[%s]},{"answer_tokens":1}]}`, t)
	}
	many := strings.TrimSuffix(strings.Repeat(`{"name":"sleep","args":{"ms":1}},`, plan.MaxToolsPerStep+1), ",")
	steps := strings.TrimSuffix(strings.Repeat(`{"tools":[{"name":"fail"}]},`, plan.MaxSteps), ",")
	deep := strings.TrimSuffix(strings.Repeat("steps[0].tools[0].args.plan.", plan.MaxDepth+1), ".")
	cases := []struct {
		name, src, path, msg string
	}{
		{"sleep ms zero", sleep(`{"ms":0}`), "steps[0].tools[1].args.ms", "must be between 1 and 3600000"},
		{"sleep ms too big", sleep(`{"ms":3600001}`), "steps[0].tools[1].args.ms", "must be between 1 and 3600000"},
		{"sleep ms wrong type", sleep(`{"ms":"2s"}`), "steps[0].tools[1].args.ms", "must be int"},
		{"sleep unknown arg", sleep(`{"ms":1,"seconds":2}`), "steps[0].tools[1].args", `unknown field "seconds"`},
		{"sleep progress too often", sleep(`{"ms":100,"progress_ms":9}`), "steps[0].tools[1].args.progress_ms", "must be 0 (no progress) or between 10 and 3600000"},
		{"sleep progress negative", sleep(`{"ms":100,"progress_ms":-1}`), "steps[0].tools[1].args.progress_ms", "must be 0 (no progress) or between 10 and 3600000"},
		{"sleep progress too big", sleep(`{"ms":100,"progress_ms":3600001}`), "steps[0].tools[1].args.progress_ms", "must be 0 (no progress) or between 10 and 3600000"},
		{"unknown top-level field", `{"steps":[{"answer_tokens":1}],"model":"x"}`, "", `unknown field "model"`},
		{"unknown step field", `{"steps":[{"answer_tokens":1,"thinking":3}]}`, "steps[0]", `unknown field "thinking"`},
		{"unknown tool", tool(`{"name":"rm_rf"}`), "steps[0].tools[0].name", `unknown tool "rm_rf"`},
		{"source tool with a bad name", tool(`{"name":"github__sea.rch"}`), "steps[0].tools[0].name", `unknown tool "github__sea.rch"`},
		{"source tool args not an object", tool(`{"name":"github__search","args":["q"]}`), "steps[0].tools[0].args", "must be a JSON object"},
		{"missing tool name", tool(`{"args":{}}`), "steps[0].tools[0].name", "is required"},
		{"last step must answer", `{"steps":[{"think_tokens":3}]}`, "steps[0].answer_tokens", "the last step must answer"},
		{"last step calls tools", `{"steps":[{"answer_tokens":3,"tools":[{"name":"fail"}]}]}`, "steps[0].tools", "the last step answers and cannot call tools"},
		{"early answer", `{"steps":[{"answer_tokens":3},{"answer_tokens":3}]}`, "steps[0].answer_tokens", "only the last step answers"},
		{"fan-out", tool(many), "steps[0].tools", "at most 16 tools per step"},
		{"no steps", `{"steps":[]}`, "steps", "must have at least one step"},
		{"missing steps", `{}`, "steps", "must have at least one step"},
		{"too many steps", fmt.Sprintf(`{"steps":[%s,{"answer_tokens":1}]}`, steps), "steps", "at most 64 steps, got 65"},
		{"tps zero", `{"tokens_per_second":0,"steps":[{"answer_tokens":1}]}`, "tokens_per_second", "must be in (0, 10000]"},
		{"tps too high", `{"tokens_per_second":10001,"steps":[{"answer_tokens":1}]}`, "tokens_per_second", "must be in (0, 10000]"},
		{"tps wrong type", `{"tokens_per_second":"fast","steps":[{"answer_tokens":1}]}`, "tokens_per_second", "must be float64"},
		{"negative think", `{"steps":[{"think_tokens":-1,"tools":[{"name":"fail"}]},{"answer_tokens":1}]}`, "steps[0].think_tokens", "must be between 0 and 1000000"},
		{"answer too big", `{"steps":[{"answer_tokens":1000001}]}`, "steps[0].answer_tokens", "must be between 0 and 1000000"},
		{"negative first token delay", `{"steps":[{"answer_tokens":1,"first_token_delay_ms":-5}]}`, "steps[0].first_token_delay_ms", "must be between 0"},
		{"model error attempts", `{"steps":[{"answer_tokens":1,"model_error":{"attempts":0}}]}`, "steps[0].model_error.attempts", "must be between 1 and 100"},
		{"model error bad code", `{"steps":[{"answer_tokens":1,"model_error":{"attempts":1,"code":"SOMETIMES"}}]}`, "steps[0].model_error.code", `unknown gRPC code "SOMETIMES"`},
		{"model error code OK", `{"steps":[{"answer_tokens":1,"model_error":{"attempts":1,"code":"ok"}}]}`, "steps[0].model_error.code", "must not be OK"},
		{"fail bad code", tool(`{"name":"fail","args":{"code":"NOPE"}}`), "steps[0].tools[0].args.code", `unknown gRPC code "NOPE"`},
		{"fail times", tool(`{"name":"fail","args":{"times":101}}`), "steps[0].tools[0].args.times", "must be between 0 and 100"},
		{"fail after", tool(`{"name":"fail","args":{"after_ms":-1}}`), "steps[0].tools[0].args.after_ms", "must be between 0"},
		{"deploy duration", tool(`{"name":"deploy","args":{"poll_ms":10}}`), "steps[0].tools[0].args.duration_ms", "must be between 1 and 3600000"},
		{"deploy cleanup", tool(`{"name":"deploy","args":{"duration_ms":10,"cleanup_ms":-1}}`), "steps[0].tools[0].args.cleanup_ms", "must be between 0 and 3600000"},
		{"spawn without plan", tool(`{"name":"spawn_subagent","args":{}}`), "steps[0].tools[0].args.task", "is required (or, for the sim model, plan)"},
		{"spawn bad nested plan", tool(`{"name":"spawn_subagent","args":{"plan":{"steps":[{"think_tokens":4,"tools":[{"name":"sleep","args":{"ms":1}}]},{"think_tokens":1}]}}}`),
			"steps[0].tools[0].args.plan.steps[1].answer_tokens", "the last step must answer"},
		{"spawn nested unknown field", tool(`{"name":"spawn_subagent","args":{"plan":{"stepz":[]}}}`), "steps[0].tools[0].args.plan", `unknown field "stepz"`},
		{"nesting too deep", nest(plan.MaxDepth + 1), deep, "nest deeper than 4"},
		// 16 + 16 × 64 calls: the 16th subagent's fourth step crosses 1024.
		{"too many tool calls in all", wide(64), "steps[0].tools[15].args.plan.steps[3].tools", "more than 1024 tools in all"},
		{"too many bytes", `{"steps":[{"answer_tokens":1}],"prompt":"` + strings.Repeat("x", plan.MaxBytes) + `"}`, "", "at most 262144 bytes"},
		{"invalid JSON", `{"steps":[}`, "", "invalid JSON at offset"},
		{"truncated JSON", `{"steps":[`, "", "ends before the object is complete"},
		{"trailing data", `{"steps":[{"answer_tokens":1}]} {}`, "", "trailing data"},
		{"not an object", `[1,2]`, "", "must be"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := plan.Parse([]byte(tc.src))
			if err == nil {
				t.Fatal("no error")
			}
			var pe *plan.Error
			if !errors.As(err, &pe) {
				t.Fatalf("error %T %v is not a *plan.Error", err, err)
			}
			if pe.Path != tc.path {
				t.Errorf("path = %q, want %q (error: %v)", pe.Path, tc.path, err)
			}
			prefix := "plan: " + tc.path + ": "
			if tc.path == "" {
				prefix = "plan: "
			}
			if msg := err.Error(); !strings.HasPrefix(msg, prefix) || !strings.Contains(msg, tc.msg) {
				t.Errorf("error = %q, want prefix %q and %q", msg, prefix, tc.msg)
			}
		})
	}
}

func TestParseCode(t *testing.T) {
	good := map[string]codes.Code{
		"UNAVAILABLE":        codes.Unavailable,
		"unavailable":        codes.Unavailable,
		"Deadline_Exceeded":  codes.DeadlineExceeded,
		"RESOURCE_EXHAUSTED": codes.ResourceExhausted,
		"CANCELLED":          codes.Canceled,
		"INTERNAL":           codes.Internal,
	}
	for s, want := range good {
		if got, err := plan.ParseCode(s); err != nil || got != want {
			t.Errorf("ParseCode(%q) = %v, %v; want %v", s, got, err, want)
		}
	}
	for _, s := range []string{"OK", "ok", "", "NOPE", "14", `"UNAVAILABLE"`} {
		if c, err := plan.ParseCode(s); err == nil {
			t.Errorf("ParseCode(%q) = %v, want an error", s, c)
		}
	}
}

func TestLooksLikePlan(t *testing.T) {
	if !plan.LooksLikePlan("  \n{\"steps\":[]}") || plan.LooksLikePlan("write a haiku") {
		t.Error("LooksLikePlan misjudged")
	}
}

func TestArgs(t *testing.T) {
	var a plan.FailArgs
	if err := plan.Args(nil, &a); err != nil || a != (plan.FailArgs{}) {
		t.Errorf("Args(empty) = %+v, %v", a, err)
	}
	err := plan.Args([]byte(`{"times":1,"bogus":true}`), &a)
	if err == nil || !strings.HasPrefix(err.Error(), `plan: args: unknown field "bogus"`) {
		t.Errorf("Args(unknown field) = %v", err)
	}
}

func FuzzParse(f *testing.F) {
	for _, src := range validPlans {
		f.Add([]byte(src))
	}
	f.Add([]byte(nest(plan.MaxDepth + 1)))
	f.Add([]byte(`{"steps":[{"tools":[{"name":"sleep","args":{"ms":"x"}}]},{"answer_tokens":1}]}`))
	f.Add([]byte(`{"tokens_per_second":1e400,"steps":null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := plan.Parse(data)
		if err != nil {
			var pe *plan.Error
			if !errors.As(err, &pe) || !strings.HasPrefix(err.Error(), "plan: ") {
				t.Fatalf("error %T %q is not a *plan.Error", err, err)
			}
			return
		}
		// A valid plan: the invariants hold and it survives a round trip.
		if len(p.Steps) == 0 || len(p.Steps) > plan.MaxSteps {
			t.Fatalf("valid plan with %d steps", len(p.Steps))
		}
		if last := p.Steps[len(p.Steps)-1]; last.AnswerTokens <= 0 || len(last.Tools) > 0 {
			t.Fatalf("valid plan whose last step does not answer: %+v", last)
		}
		if tps := p.TPS(); tps <= 0 || tps > plan.MaxTokensPerSecond {
			t.Fatalf("valid plan with TPS %v", tps)
		}
		out, err := json.Marshal(p)
		if err != nil {
			t.Fatalf("marshal a valid plan: %v", err)
		}
		if _, err := plan.Parse(out); err != nil {
			t.Fatalf("re-parse of %s: %v (input %q)", out, err, data)
		}
	})
}

// A plan may call a tool source's tool by its source__tool name with an object of
// arguments; whether it exists, and its arguments' schema, are toolrunner's to check.
func TestParseSourceTools(t *testing.T) {
	p, err := plan.Parse([]byte(`{"steps":[{"tools":[{"name":"github__search_issues","args":{"q":"bug","limit":5}},` +
		`{"name":"fs__list"},{"name":"my-src__x","args":{},"idempotency_key":"k"}]},{"answer_tokens":1}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(p.Steps[0].Tools); n != 3 {
		t.Fatalf("%d tools", n)
	}
	for name, want := range map[string]bool{"github__search": true, "a__b": true, "a-b__c-d": true, "sleep": false, "rm_rf": false,
		"__x": false, "a__b.c": false, "a__" + strings.Repeat("x", 62): false} {
		if plan.IsSourceTool(name) != want {
			t.Errorf("IsSourceTool(%q) = %v", name, !want)
		}
	}
}

func TestApprovals(t *testing.T) {
	task := `{"steps":[{"tools":[{"name":"sleep","args":{"ms":1}},{"name":"notify","args":{"channel":"c","message":"m"},"approval":true}]},` +
		`{"tools":[{"name":"notify","args":{"channel":"c","message":"m"},"approval":true}]},{"answer_tokens":1}]}`
	got := plan.Approvals(task)
	if len(got) != 2 || !got[plan.CallID(0, 1)] || !got[plan.CallID(1, 0)] || got[plan.CallID(0, 0)] {
		t.Fatalf("Approvals = %v", got)
	}
	if got := plan.Approvals("deploy it"); got != nil {
		t.Fatalf("not a plan: %v", got)
	}
	if got := plan.Approvals(`{"steps":[{"answer_tokens":1}]}`); got != nil {
		t.Fatalf("no approvals: %v", got)
	}
}
