package catalog

import (
	"fmt"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// Builtins returns the built-in tools, in the order models are told of them (fail, which
// no model is told of, last). Each call returns values of its own. Every spec's schema
// matches what plan.ValidateTool accepts; ValidateTool still checks every call, since a
// schema is advice to the model, not a guarantee.
func Builtins() []Tool {
	ms := func(desc string, lo int) string {
		return fmt.Sprintf(`{"type": "integer", "minimum": %d, "maximum": %d, "description": %q}`, lo, plan.MaxSleepMS, desc)
	}
	return []Tool{
		{
			Name:        plan.ToolSleep,
			SideEffects: None,
			Spec: &modelproxyv1.ToolSpec{
				Name:        plan.ToolSleep,
				Description: "Wait for a number of milliseconds, then return. Stops at once when the run is cancelled.",
				ParametersJson: `{"type": "object", "additionalProperties": false, "required": ["ms"], "properties": {"ms": ` +
					ms("milliseconds to wait", 1) + `, "progress_ms": ` +
					ms("optional: report progress every this many milliseconds", plan.MinProgressMS) + `}}`,
			},
		},
		{
			// deploy starts a job: a second run starts a second job.
			Name:        plan.ToolDeploy,
			SideEffects: Irreversible,
			Spec: &modelproxyv1.ToolSpec{
				Name: plan.ToolDeploy,
				Description: "Start a deployment job and wait for it to finish. It has a side effect: the job starts " +
					"once per call, and a cancelled call aborts it.",
				ParametersJson: `{"type": "object", "additionalProperties": false, "required": ["duration_ms"], "properties": {` +
					`"duration_ms": ` + ms("how long the job runs", 1) + `, ` +
					`"poll_ms": ` + ms("how often the job is polled", 0) + `, ` +
					`"abort_ms": ` + ms("how long aborting the job takes", 0) + `, ` +
					`"cleanup_ms": ` + ms("the budget for aborting after a cancel", 0) + `}}`,
			},
		},
		{
			Name:        plan.ToolKVPut,
			SideEffects: Idempotent,
			Durable:     true,
			Spec: &modelproxyv1.ToolSpec{
				Name: plan.ToolKVPut,
				Description: "Write a JSON value under a key in the tenant's key-value store. Durable and idempotent: " +
					"the same call in the same place of a run writes once, however often it is retried.",
				ParametersJson: fmt.Sprintf(`{"type": "object", "additionalProperties": false, "required": ["key", "value"], "properties": {`+
					`"key": {"type": "string", "minLength": 1, "maxLength": %d}, "value": {"description": "any JSON value"}}}`, plan.MaxKVKeyLen),
			},
		},
		{
			// notify sends a message, once per key: toolrunner keys every call (Durable).
			Name:        plan.ToolNotify,
			SideEffects: Irreversible,
			Durable:     true,
			Spec: &modelproxyv1.ToolSpec{
				Name: plan.ToolNotify,
				Description: "Send a notification (appended to the tenant's outbox). Irreversible: it happens once per call, " +
					"never after the run is cancelled, and not when less than grace_ms is left.",
				ParametersJson: fmt.Sprintf(`{"type": "object", "additionalProperties": false, "required": ["channel"], "properties": {`+
					`"channel": {"type": "string", "minLength": 1, "maxLength": %d}, "message": {"type": "string", "maxLength": %d}, `+
					`"grace_ms": {"type": "integer", "minimum": 0, "maximum": %d}}}`, plan.MaxKVKeyLen, plan.MaxNotifyBytes, plan.MaxSleepMS),
			},
		},
		{
			// The subagent's own tool calls declare their own effects.
			Name:        plan.ToolSpawnSubagent,
			SideEffects: None,
			RunsModels:  true, // never hedged: a backup would run a second subagent's decoders
			Spec: &modelproxyv1.ToolSpec{
				Name: plan.ToolSpawnSubagent,
				Description: "Run a nested agent loop on a task under the run's deadline and return its answer as {\"answer\": ...}. " +
					"Give task (or, for the sim model, plan), and optionally the subagent's model, the tools it may use, " +
					"the bound on its output tokens per step, and the time it keeps for its own final answer (reserve). It runs under your deadline less your own reserve; if it runs out of time it returns what it had, marked partial.",
				ParametersJson: fmt.Sprintf(`{"type": "object", "additionalProperties": false, "properties": {`+
					`"task": {"type": "string", "minLength": 1, "description": "what the subagent is to do: its user message"}, `+
					`"plan": {"type": "object", "description": "instead of task, for the sim model only: the subagent's JSON plan {\"steps\": [...]} (docs/plan.md)"}, `+
					`"model": {"type": "string", "maxLength": %d, "description": "the subagent's model; the subagent service's default when omitted"}, `+
					`"tools": {"type": "array", "maxItems": %d, "items": {"type": "string", "minLength": 1}, "description": "the only tools the subagent may use; all of the run's when omitted"}, `+
					`"max_tokens": {"type": "integer", "minimum": 0, "maximum": %d, "description": "bound on the output tokens of each of the subagent's model steps; the provider's default when omitted"}, `+
					`"reserve": {"type": "string", "description": "the time the subagent keeps for its final answer: a duration like \"2s\" or a fraction of its time left like \"0.2\"; its own tools and subagents stop that long before its deadline"}}}`,
					plan.MaxModelNameLen, plan.MaxSpawnTools, plan.MaxTokens),
			},
		},
		{
			// fail is a fault for tests and drills: plans call it, models are not told of it.
			Name:        plan.ToolFail,
			SideEffects: None,
		},
	}
}

// Specs returns the specs of the built-in tools models are told of, in Builtins' order.
func Specs() []*modelproxyv1.ToolSpec {
	var out []*modelproxyv1.ToolSpec
	for _, t := range Builtins() {
		if t.Spec != nil {
			out = append(out, t.Spec)
		}
	}
	return out
}

// builtins holds the built-ins by name, for the lookups below (their specs unused).
var builtins = func() map[string]Tool {
	m := map[string]Tool{}
	for _, t := range Builtins() {
		m[t.Name] = t
	}
	return m
}()

// IsBuiltin reports whether name is a built-in tool.
func IsBuiltin(name string) bool {
	_, ok := builtins[name]
	return ok
}

// NeedsKey reports whether a call of the tool name may run a second time only with the
// caller's idempotency key: for a built-in, Tool.NeedsKey; for any other name (a tool
// source's, whose effects only toolrunner's registry knows), true. Toolrunner retries
// such a tool itself as far as its effects allow; its callers retry it, or resume a run
// at it, only with a key.
func NeedsKey(name string) bool {
	t, ok := builtins[name]
	return !ok || t.NeedsKey()
}

// Hedgeable reports whether a call of the tool name may get a hedged backup: for a
// built-in, Tool.Hedgeable; false for any other name (a tool source's, whose effects
// the caller learns from toolrunner's list: toollist.Tools.Hedgeable).
func Hedgeable(name string) bool {
	t, ok := builtins[name]
	return ok && t.Hedgeable()
}

// Durable reports whether name is a built-in whose effect toolrunner keeps in its store
// under an idempotency key (Tool.Durable); false for any other name.
func Durable(name string) bool { return builtins[name].Durable }
