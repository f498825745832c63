package openaiapi

import (
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// usage is OpenAI's token usage: the run's, over every model node of its tree, subagents
// included (docs/openai.md).
type usage struct {
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
	TotalTokens      int64 `json:"total_tokens"`
}

func usageOf(r *orchestratorv1.Run) *usage {
	return &usage{PromptTokens: r.GetPromptTokens(), CompletionTokens: r.GetTokens(), TotalTokens: r.GetPromptTokens() + r.GetTokens()}
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type choice struct {
	Index        int     `json:"index"`
	Message      message `json:"message"`
	FinishReason string  `json:"finish_reason"`
	Logprobs     any     `json:"logprobs"`
}

type chatCompletion struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []choice `json:"choices"`
	Usage   *usage   `json:"usage"`
}

// modelOf is the model a run answered with: the one it was started with, else the
// request's.
func modelOf(r *orchestratorv1.Run, asked string) string {
	if m := r.GetModel(); m != "" {
		return m
	}
	return asked
}

// completion is the chat.completion of a run that succeeded: its id is the run's.
func completion(r *orchestratorv1.Run, asked string) chatCompletion {
	return chatCompletion{
		ID: r.GetRunId(), Object: "chat.completion", Created: r.GetCreatedAt().GetSeconds(), Model: modelOf(r, asked),
		Choices: []choice{{Message: message{Role: "assistant", Content: r.GetAnswer()}, FinishReason: "stop"}},
		Usage:   usageOf(r),
	}
}
