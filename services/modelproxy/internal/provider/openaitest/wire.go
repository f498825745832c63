package openaitest

import (
	"encoding/json"
	"strings"
)

// ChatRequest is a chat completions request body as the server decoded it. Optional
// scalars are pointers, nil when the client did not send them.
type ChatRequest struct {
	Model               string          `json:"model"`
	Messages            []Message       `json:"messages"`
	Stream              bool            `json:"stream"`
	StreamOptions       *StreamOptions  `json:"stream_options,omitempty"`
	Tools               []Tool          `json:"tools,omitempty"`
	ToolChoice          json.RawMessage `json:"tool_choice,omitempty"`
	ResponseFormat      *ResponseFormat `json:"response_format,omitempty"`
	Temperature         *float64        `json:"temperature,omitempty"`
	Seed                *int64          `json:"seed,omitempty"`
	MaxTokens           *int            `json:"max_tokens,omitempty"`
	MaxCompletionTokens *int            `json:"max_completion_tokens,omitempty"`
	N                   *int            `json:"n,omitempty"`
}

// IncludeUsage reports whether the request asked for the usage chunk.
func (r *ChatRequest) IncludeUsage() bool {
	return r.StreamOptions != nil && r.StreamOptions.IncludeUsage
}

// StreamOptions is the request's stream_options.
type StreamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

// Message is one message of a request. Content is the text of a string content or of an
// array of text parts, joined.
type Message struct {
	Role       string            `json:"role"`
	Content    string            `json:"content"`
	Name       string            `json:"name,omitempty"`
	ToolCalls  []MessageToolCall `json:"tool_calls,omitempty"`
	ToolCallID string            `json:"tool_call_id,omitempty"`
}

// UnmarshalJSON reads content as a string, null or an array of text parts.
func (m *Message) UnmarshalJSON(b []byte) error {
	type plain Message
	var v struct {
		plain
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	*m = Message(v.plain)
	m.Content = ""
	if len(v.Content) == 0 || string(v.Content) == "null" {
		return nil
	}
	if err := json.Unmarshal(v.Content, &m.Content); err == nil {
		return nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(v.Content, &parts); err != nil {
		return err
	}
	var sb strings.Builder
	for _, p := range parts {
		sb.WriteString(p.Text)
	}
	m.Content = sb.String()
	return nil
}

// MessageToolCall is a tool call of an assistant message.
type MessageToolCall struct {
	ID       string       `json:"id"`
	Type     string       `json:"type"`
	Function FunctionCall `json:"function"`
}

// FunctionCall is a called function and its arguments JSON.
type FunctionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// Tool is a tool offered in a request.
type Tool struct {
	Type     string   `json:"type"`
	Function Function `json:"function"`
}

// Function describes a function tool; Parameters is its JSON Schema as sent.
type Function struct {
	Name        string          `json:"name"`
	Description string          `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
	Strict      *bool           `json:"strict,omitempty"`
}

// ResponseFormat is the request's response_format.
type ResponseFormat struct {
	Type       string      `json:"type"`
	JSONSchema *JSONSchema `json:"json_schema,omitempty"`
}

// JSONSchema is a json_schema response format; Schema is the schema as sent.
type JSONSchema struct {
	Name   string          `json:"name"`
	Schema json.RawMessage `json:"schema,omitempty"`
	Strict *bool           `json:"strict,omitempty"`
}

// The response side, in OpenAI's field order; nulls are written where OpenAI writes them.

type chunkJSON struct {
	ID                string          `json:"id"`
	Object            string          `json:"object"`
	Created           int64           `json:"created"`
	Model             string          `json:"model"`
	SystemFingerprint string          `json:"system_fingerprint"`
	Choices           []choiceJSON    `json:"choices"`
	Usage             json.RawMessage `json:"usage,omitempty"` // null on every chunk but the last when include_usage
}

type choiceJSON struct {
	Index        int             `json:"index"`
	Delta        deltaJSON       `json:"delta"`
	Logprobs     json.RawMessage `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
}

type deltaJSON struct {
	Role      string              `json:"role,omitempty"`
	Content   json.RawMessage     `json:"content,omitempty"`
	ToolCalls []toolCallDeltaJSON `json:"tool_calls,omitempty"`
	Refusal   json.RawMessage     `json:"refusal,omitempty"`
}

type toolCallDeltaJSON struct {
	Index    int          `json:"index"`
	ID       string       `json:"id,omitempty"`
	Type     string       `json:"type,omitempty"`
	Function functionJSON `json:"function"`
}

type functionJSON struct {
	Name      string `json:"name,omitempty"`
	Arguments string `json:"arguments"`
}

type usageJSON struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

type completionJSON struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	Choices           []completionChoice `json:"choices"`
	Usage             usageJSON          `json:"usage"`
	SystemFingerprint string             `json:"system_fingerprint"`
}

type completionChoice struct {
	Index        int               `json:"index"`
	Message      completionMessage `json:"message"`
	Logprobs     json.RawMessage   `json:"logprobs"`
	FinishReason string            `json:"finish_reason"`
}

type completionMessage struct {
	Role      string            `json:"role"`
	Content   *string           `json:"content"`
	Refusal   json.RawMessage   `json:"refusal"`
	ToolCalls []MessageToolCall `json:"tool_calls,omitempty"`
}

type errorJSON struct {
	Error errorObject `json:"error"`
}

type errorObject struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

func errorBody(e APIError) []byte {
	o := errorObject{Message: e.Message, Type: e.Type}
	if e.Param != "" {
		o.Param = &e.Param
	}
	if e.Code != "" {
		o.Code = &e.Code
	}
	b, _ := json.Marshal(errorJSON{Error: o})
	return b
}

var jsonNull = json.RawMessage("null")
