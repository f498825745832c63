package plan

import (
	"fmt"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
)

// ToolSpecs describes the built-in tools to a real model: a name, what the tool does,
// and the JSON Schema of its arguments, matching what ValidateTool accepts (ValidateTool
// still checks every call: a schema is advice to the model, not a guarantee).
func ToolSpecs() []*modelproxyv1.ToolSpec {
	ms := func(desc string, lo int) string {
		return fmt.Sprintf(`{"type": "integer", "minimum": %d, "maximum": %d, "description": %q}`, lo, MaxSleepMS, desc)
	}
	return []*modelproxyv1.ToolSpec{
		{
			Name:        ToolSleep,
			Description: "Wait for a number of milliseconds, then return. Stops at once when the run is cancelled.",
			ParametersJson: `{"type": "object", "additionalProperties": false, "required": ["ms"], "properties": {"ms": ` +
				ms("milliseconds to wait", 1) + `}}`,
		},
		{
			Name: ToolDeploy,
			Description: "Start a deployment job and wait for it to finish. It has a side effect: the job starts " +
				"once per call, and a cancelled call aborts it.",
			ParametersJson: `{"type": "object", "additionalProperties": false, "required": ["duration_ms"], "properties": {` +
				`"duration_ms": ` + ms("how long the job runs", 1) + `, ` +
				`"poll_ms": ` + ms("how often the job is polled", 0) + `, ` +
				`"abort_ms": ` + ms("how long aborting the job takes", 0) + `, ` +
				`"cleanup_ms": ` + ms("the budget for aborting after a cancel", 0) + `}}`,
		},
		{
			Name: ToolKVPut,
			Description: "Write a JSON value under a key in the tenant's key-value store. Durable and idempotent: " +
				"the same call in the same place of a run writes once, however often it is retried.",
			ParametersJson: fmt.Sprintf(`{"type": "object", "additionalProperties": false, "required": ["key", "value"], "properties": {`+
				`"key": {"type": "string", "minLength": 1, "maxLength": %d}, "value": {"description": "any JSON value"}}}`, MaxKVKeyLen),
		},
		{
			Name: ToolNotify,
			Description: "Send a notification (appended to the tenant's outbox). Irreversible: it happens once per call, " +
				"never after the run is cancelled, and not when less than grace_ms is left.",
			ParametersJson: fmt.Sprintf(`{"type": "object", "additionalProperties": false, "required": ["channel"], "properties": {`+
				`"channel": {"type": "string", "minLength": 1, "maxLength": %d}, "message": {"type": "string", "maxLength": %d}, `+
				`"grace_ms": {"type": "integer", "minimum": 0, "maximum": %d}}}`, MaxKVKeyLen, MaxNotifyBytes, MaxSleepMS),
		},
		{
			Name:        ToolSpawnSubagent,
			Description: "Run a nested agent on a plan (the sim model's JSON plan format, see the README) under the run's deadline.",
			ParametersJson: `{"type": "object", "additionalProperties": false, "required": ["plan"], "properties": {` +
				`"plan": {"type": "object", "description": "the subagent's plan: {\"steps\": [...]}"}}}`,
		},
	}
}
