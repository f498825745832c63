// Package plan parses and validates the JSON plans that script the built-in `sim` model,
// and the arguments of the built-in tools that plans call. What a model is told of those
// tools, and their side effects, are the tool catalogue's (mesh/catalog).
//
// A plan is the task of a run when the model is `sim`. The sim model decides each next
// step from how many assistant turns the conversation already has, so the real agent
// loop, tool dispatch and subagents run unchanged. Errors name the bad field by its path
// ("steps[1].tools[0].args.ms: must be between 1 and 3600000").
package plan
