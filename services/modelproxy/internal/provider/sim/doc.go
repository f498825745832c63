// Package sim is the built-in `sim` model as a provider.Provider: a decoder scripted by a
// JSON plan (package plan) carried as the conversation's first user message. The step it
// decodes is picked by the number of assistant turns so far; its tokens come at the plan's
// rate on an absolute schedule, and its tool calls and model_error fault are the plan's.
//
// A sim stream stops at the next token boundary once its context is cancelled: the wait
// for each token selects on the context, so a cancel costs at most the token being
// emitted.
//
// Each word of output is one token; the prompt's tokens are counted by the same rule
// (PromptTokens) and reported in the usage of a step's final chunk.
package sim
