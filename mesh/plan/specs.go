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
			Name:        ToolSpawnSubagent,
			Description: "Run a nested agent on a plan (the sim model's JSON plan format, see the README) under the run's deadline.",
			ParametersJson: `{"type": "object", "additionalProperties": false, "required": ["plan"], "properties": {` +
				`"plan": {"type": "object", "description": "the subagent's plan: {\"steps\": [...]}"}}}`,
		},
	}
}
