package agent

import (
	"context"
	"encoding/json"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
)

// EntryKind says what a journal entry holds.
type EntryKind string

// Entry kinds. Each agent step records up to two entries, in this order.
const (
	// EntryModel is a completed model step: its text, finish reason and tool calls.
	EntryModel EntryKind = "model"
	// EntryTools is the results of a step's tool calls, all of them, in call order.
	EntryTools EntryKind = "tools"
)

// Entry is one record of a loop's journal.
type Entry struct {
	// Seq is the entry's position in the journal (0-based), set by the journal.
	Seq  int
	Step int // the agent step, 0-based
	Kind EntryKind
	// Model entries.
	Text         string
	FinishReason string
	ToolCalls    []*modelproxyv1.ToolCall
	Tokens       int64 // the output tokens the step's decoder spent
	// Tools entries.
	ToolOutputs []string
}

// Journal persists a loop's progress so that a loop resumed after its process died does
// not repeat completed work (see Loop.RunJournaled). Implementations fence their writes:
// a journal whose owner has lost the run returns an error from Record, which stops the
// loop before it does anything else.
type Journal interface {
	// Replay returns the entries recorded before, by ascending Seq.
	Replay() []Entry
	// Record durably appends e (with Seq set to its position) before the loop goes on.
	Record(ctx context.Context, e Entry) error
}

// entryJSON is an Entry's encoding: tool calls as protojson, the rest as plain JSON.
type entryJSON struct {
	Step         int               `json:"step"`
	Kind         EntryKind         `json:"kind"`
	Text         string            `json:"text,omitempty"`
	FinishReason string            `json:"finish_reason,omitempty"`
	ToolCalls    []json.RawMessage `json:"tool_calls,omitempty"`
	ToolOutputs  []string          `json:"tool_outputs,omitempty"`
}

// MarshalEntry encodes e (all but Seq and Tokens, which a journal keeps beside it).
func MarshalEntry(e Entry) ([]byte, error) {
	j := entryJSON{Step: e.Step, Kind: e.Kind, Text: e.Text, FinishReason: e.FinishReason, ToolOutputs: e.ToolOutputs}
	for _, c := range e.ToolCalls {
		b, err := protojson.Marshal(c)
		if err != nil {
			return nil, err
		}
		j.ToolCalls = append(j.ToolCalls, b)
	}
	return json.Marshal(j)
}

// UnmarshalEntry decodes what MarshalEntry encoded.
func UnmarshalEntry(b []byte) (Entry, error) {
	var j entryJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return Entry{}, fmt.Errorf("journal entry: %w", err)
	}
	if j.Kind != EntryModel && j.Kind != EntryTools {
		return Entry{}, fmt.Errorf("journal entry: unknown kind %q", j.Kind)
	}
	e := Entry{Step: j.Step, Kind: j.Kind, Text: j.Text, FinishReason: j.FinishReason, ToolOutputs: j.ToolOutputs}
	for _, raw := range j.ToolCalls {
		c := &modelproxyv1.ToolCall{}
		if err := protojson.Unmarshal(raw, c); err != nil {
			return Entry{}, fmt.Errorf("journal entry: tool call: %w", err)
		}
		e.ToolCalls = append(e.ToolCalls, c)
	}
	return e, nil
}
