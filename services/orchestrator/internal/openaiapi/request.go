package openaiapi

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// chatRequest is the part of OpenAI's chat completion request curfew honours; fields it
// does not know are ignored, as OpenAI's own SDKs expect of a server.
type chatRequest struct {
	Model               string          `json:"model"`
	Messages            []chatMessage   `json:"messages"`
	MaxTokens           *int32          `json:"max_tokens"`
	MaxCompletionTokens *int32          `json:"max_completion_tokens"`
	Temperature         *float64        `json:"temperature"`
	ResponseFormat      *responseFormat `json:"response_format"`
	Tools               []chatTool      `json:"tools"`
	Stream              bool            `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	N *int `json:"n"`

	// registered is the registry's tool names the key's tenant may use, for the tools rule.
	registered func(ctx context.Context, apiKey string) (map[string]bool, error)
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
	// On assistant messages: the tools it called.
	ToolCalls []chatToolCall `json:"tool_calls"`
	// On tool messages: the call this is the result of.
	ToolCallID string `json:"tool_call_id"`
}

// chatToolCall is an assistant message's tool call in OpenAI's shape.
type chatToolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

type responseFormat struct {
	Type       string `json:"type"`
	JSONSchema *struct {
		Name   string          `json:"name"`
		Schema json.RawMessage `json:"schema"`
	} `json:"json_schema"`
}

type chatTool struct {
	Type     string `json:"type"`
	Function *struct {
		Name string `json:"name"`
	} `json:"function"`
}

func decodeRequest(r io.Reader) (*chatRequest, error) {
	var req chatRequest
	if err := json.NewDecoder(r).Decode(&req); err != nil {
		return nil, invalid("", "the body is not a JSON chat completion request: %v", err)
	}
	return &req, nil
}

// isNull reports whether a message's content is absent or null.
func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || bytes.Equal(raw, []byte("null"))
}

// content returns a message's text: a string, or an array of text parts.
func (m chatMessage) content(i int) (string, error) {
	raw := bytes.TrimSpace(m.Content)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", invalid(fmt.Sprintf("messages[%d].content", i), "messages[%d].content: required", i)
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", invalid(fmt.Sprintf("messages[%d].content", i), "messages[%d].content: a string or an array of text parts", i)
	}
	var b bytes.Buffer
	for j, p := range parts {
		if p.Type != "text" {
			return "", invalid(fmt.Sprintf("messages[%d].content[%d].type", i, j),
				"messages[%d].content[%d].type: %q is not supported; only text parts are", i, j, p.Type)
		}
		b.WriteString(p.Text)
	}
	return b.String(), nil
}

// runRequest is the run of the request: its last message, a user message, is the task
// (with the sim model, the JSON plan); the messages before it are the conversation.
func (c *chatRequest) runRequest(ctx context.Context) (*orchestratorv1.RunRequest, error) {
	if len(c.Messages) == 0 {
		return nil, invalid("messages", "messages: at least one message is required")
	}
	if c.N != nil && *c.N != 1 {
		return nil, invalid("n", "n: only 1 choice is supported")
	}
	run := &orchestratorv1.RunRequest{Model: c.Model, Temperature: c.Temperature}
	for i, m := range c.Messages {
		var text string
		// An assistant message that called tools may have no content.
		if callsOnly := m.Role == "assistant" && len(m.ToolCalls) > 0 && isNull(m.Content); !callsOnly {
			var err error
			if text, err = m.content(i); err != nil {
				return nil, err
			}
		}
		var role orchestratorv1.MessageRole
		switch m.Role {
		case "system", "developer":
			role = orchestratorv1.MessageRole_MESSAGE_ROLE_SYSTEM
		case "user":
			role = orchestratorv1.MessageRole_MESSAGE_ROLE_USER
		case "assistant":
			role = orchestratorv1.MessageRole_MESSAGE_ROLE_ASSISTANT
		case "tool":
			// A prior tool turn: the result of an earlier assistant message's call (the
			// orchestrator checks that tool_call_id names one).
			role = orchestratorv1.MessageRole_MESSAGE_ROLE_TOOL
		default:
			return nil, invalid(fmt.Sprintf("messages[%d].role", i),
				"messages[%d].role: %q is not supported; use system, user, assistant or tool", i, m.Role)
		}
		if i == len(c.Messages)-1 {
			if role != orchestratorv1.MessageRole_MESSAGE_ROLE_USER {
				return nil, invalid(fmt.Sprintf("messages[%d].role", i), "messages[%d].role: the last message must be the user's", i)
			}
			run.Task = text
			break
		}
		msg := &orchestratorv1.Message{Role: role, Content: text, ToolCallId: m.ToolCallID}
		for j, tc := range m.ToolCalls {
			if tc.Type != "" && tc.Type != "function" {
				return nil, invalid(fmt.Sprintf("messages[%d].tool_calls[%d].type", i, j),
					"messages[%d].tool_calls[%d].type: %q is not supported; only function calls are", i, j, tc.Type)
			}
			msg.ToolCalls = append(msg.ToolCalls, &orchestratorv1.ToolCall{Id: tc.ID, Name: tc.Function.Name, ArgumentsJson: tc.Function.Arguments})
		}
		run.Messages = append(run.Messages, msg)
	}
	switch {
	case c.MaxCompletionTokens != nil:
		run.MaxTokens = *c.MaxCompletionTokens
	case c.MaxTokens != nil:
		run.MaxTokens = *c.MaxTokens
	}
	if f := c.ResponseFormat; f != nil {
		switch f.Type {
		case "text":
		case "json_schema":
			if f.JSONSchema == nil || len(f.JSONSchema.Schema) == 0 {
				return nil, invalid("response_format.json_schema.schema", "response_format.json_schema.schema: required")
			}
			run.ResponseSchemaJson = string(f.JSONSchema.Schema)
		default:
			return nil, invalid("response_format.type", "response_format.type: %q is not supported; use text or json_schema", f.Type)
		}
	}
	if len(c.Tools) > 0 {
		var known map[string]bool
		if c.registered != nil {
			var err error
			if known, err = c.registered(ctx, keyFrom(ctx)); err != nil {
				return nil, err
			}
		}
		for i, t := range c.Tools {
			if t.Type != "function" || t.Function == nil || t.Function.Name == "" {
				return nil, invalid(fmt.Sprintf("tools[%d]", i), `tools[%d]: must be {"type": "function", "function": {"name": "<registry name>"}}`, i)
			}
			if known != nil && !known[t.Function.Name] {
				return nil, invalid(fmt.Sprintf("tools[%d].function.name", i),
					"curfew runs its own tools; %s is not a registered tool", t.Function.Name)
			}
			run.Tools = append(run.Tools, t.Function.Name)
		}
	}
	return run, nil
}
