package orchestrator

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/santhosh-tekuri/jsonschema/v6"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// Bounds of a run's input.
const (
	// MaxTemperature is the highest sampling temperature a run may ask for.
	MaxTemperature = 2.0
	// maxMessages bounds a run's conversation.
	maxMessages = 1000
)

// runInput gathers the input fields of a RunRequest or StartRunRequest; nil when none is
// set (a run started with a task alone), so that such a run stores and compares as before.
func runInput(msgs []*orchestratorv1.Message, maxTokens int32, temperature *float64, schema string,
	tools []string, maxSteps int32, toolErrors orchestratorv1.ToolErrors, reserve string) *orchestratorv1.RunInput {
	in := &orchestratorv1.RunInput{Messages: msgs, MaxTokens: maxTokens, Temperature: temperature,
		ResponseSchemaJson: schema, Tools: tools, MaxSteps: maxSteps, ToolErrors: toolErrors, Reserve: reserve}
	if proto.Size(in) == 0 {
		return nil
	}
	return in
}

// validateInput checks a run's input; its errors are INVALID_ARGUMENT naming the field.
// maxSteps is the service's step limit, which a run may lower but not raise.
func validateInput(task, model string, in *orchestratorv1.RunInput, maxSteps int) error {
	bad := func(field, format string, args ...any) error {
		return status.Errorf(codes.InvalidArgument, "%s: %s", field, fmt.Sprintf(format, args...))
	}
	msgs := in.GetMessages()
	if len(msgs) > maxMessages {
		return bad("messages", "at most %d messages, got %d", maxMessages, len(msgs))
	}
	users := 0
	calls := map[string]bool{} // the tool call ids of the assistant messages so far
	for i, m := range msgs {
		field := fmt.Sprintf("messages[%d]", i)
		switch m.GetRole() {
		case orchestratorv1.MessageRole_MESSAGE_ROLE_SYSTEM:
			if i != 0 {
				return bad(field+".role", "a system message must be the first")
			}
		case orchestratorv1.MessageRole_MESSAGE_ROLE_USER:
			users++
			if model == agent.DefaultModel {
				return bad(field+".role", "the sim model takes its plan from task, not from user messages")
			}
		case orchestratorv1.MessageRole_MESSAGE_ROLE_ASSISTANT:
			for j, c := range m.GetToolCalls() {
				cf := fmt.Sprintf("%s.tool_calls[%d]", field, j)
				switch {
				case c.GetId() == "":
					return bad(cf+".id", "required")
				case calls[c.GetId()]:
					return bad(cf+".id", "%q is the id of an earlier call", c.GetId())
				case c.GetName() == "":
					return bad(cf+".name", "required")
				}
				if a := c.GetArgumentsJson(); a != "" && !json.Valid([]byte(a)) {
					return bad(cf+".arguments_json", "not JSON")
				}
				calls[c.GetId()] = true
			}
		case orchestratorv1.MessageRole_MESSAGE_ROLE_TOOL:
			switch id := m.GetToolCallId(); {
			case id == "":
				return bad(field+".tool_call_id", "required on a tool message")
			case !calls[id]:
				return bad(field+".tool_call_id", "%q names no tool call of an earlier assistant message", id)
			}
		default:
			return bad(field+".role", "must be system, user, assistant or tool, got %v", m.GetRole())
		}
		if m.GetToolCallId() != "" && m.GetRole() != orchestratorv1.MessageRole_MESSAGE_ROLE_TOOL {
			return bad(field+".tool_call_id", "only a tool message has one")
		}
		if len(m.GetToolCalls()) > 0 && m.GetRole() != orchestratorv1.MessageRole_MESSAGE_ROLE_ASSISTANT {
			return bad(field+".tool_calls", "only an assistant message has them")
		}
		if strings.TrimSpace(m.GetContent()) == "" && len(m.GetToolCalls()) == 0 {
			return bad(field+".content", "required")
		}
	}
	if task == "" && users == 0 {
		return status.Error(codes.InvalidArgument, "task is required (or, with a model other than sim, a user message in messages)")
	}
	if in.GetMaxTokens() < 0 {
		return bad("max_tokens", "must not be negative, got %d", in.GetMaxTokens())
	}
	if in != nil && in.Temperature != nil {
		if t := in.GetTemperature(); math.IsNaN(t) || t < 0 || t > MaxTemperature {
			return bad("temperature", "must be between 0 and %g, got %g", MaxTemperature, t)
		}
	}
	if s := in.GetResponseSchemaJson(); s != "" {
		if err := checkSchema(s); err != nil {
			return bad("response_schema_json", "%v", err)
		}
	}
	for i, name := range in.GetTools() {
		switch {
		case name == "":
			return bad(fmt.Sprintf("tools[%d]", i), "empty tool name")
		case slices.Index(in.GetTools(), name) != i:
			return bad(fmt.Sprintf("tools[%d]", i), "%q is listed twice", name)
		}
	}
	if n := in.GetMaxSteps(); n < 0 || int(n) > maxSteps {
		return bad("max_steps", "must be between 0 (the service's limit) and %d, got %d", maxSteps, n)
	}
	if _, ok := orchestratorv1.ToolErrors_name[int32(in.GetToolErrors())]; !ok {
		return bad("tool_errors", "unknown policy %d", in.GetToolErrors())
	}
	if _, err := plan.ParseReserve(in.GetReserve()); err != nil {
		return bad("reserve", "%v", err)
	}
	return nil
}

// checkSchema reports whether s is a JSON Schema that compiles.
func checkSchema(s string) error {
	doc, err := jsonschema.UnmarshalJSON(strings.NewReader(s))
	if err != nil {
		return fmt.Errorf("not JSON: %w", err)
	}
	if _, ok := doc.(map[string]any); !ok {
		return fmt.Errorf("not a JSON Schema object")
	}
	c := jsonschema.NewCompiler()
	if err := c.AddResource("response.json", doc); err != nil {
		return err
	}
	if _, err := c.Compile("response.json"); err != nil {
		return fmt.Errorf("does not compile: %s", strings.ReplaceAll(err.Error(), "\n", " "))
	}
	return nil
}

// encodeInput is the input as the store keeps it: deterministic, so that an idempotency
// key's comparison is byte for byte; empty for none.
func encodeInput(in *orchestratorv1.RunInput) []byte {
	if in == nil {
		return nil
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(in)
	if err != nil {
		panic(fmt.Sprintf("orchestrator: encode run input: %v", err)) // a valid message always encodes
	}
	return b
}

// decodeInput is the stored input; nil for none, or for bytes that do not decode (a run
// of a newer version: it runs on its task).
func decodeInput(b []byte) *orchestratorv1.RunInput {
	if len(b) == 0 {
		return nil
	}
	in := &orchestratorv1.RunInput{}
	if err := proto.Unmarshal(b, in); err != nil {
		return nil
	}
	return in
}

// sameInput reports whether two inputs are the same request's.
func sameInput(a, b *orchestratorv1.RunInput) bool {
	return proto.Equal(a, b)
}

// loopInput is what the agent loop runs for a run of model, task and in.
func loopInput(model, task string, in *orchestratorv1.RunInput) agent.Input {
	li := agent.Input{Model: model, Task: task, MaxTokens: in.GetMaxTokens(),
		ResponseSchema: in.GetResponseSchemaJson(), Tools: in.GetTools(), MaxSteps: int(in.GetMaxSteps()),
		FailOnToolError: in.GetToolErrors() == orchestratorv1.ToolErrors_TOOL_ERRORS_FAIL_RUN}
	// Validated at the start; a stored input of a newer version that does not parse
	// keeps no reserve.
	li.Reserve, _ = plan.ParseReserve(in.GetReserve())
	if in != nil {
		li.Temperature = in.Temperature
	}
	for _, m := range in.GetMessages() {
		mm := &modelproxyv1.Message{Role: modelRole(m.GetRole()), Content: m.GetContent(), ToolCallId: m.GetToolCallId()}
		for _, c := range m.GetToolCalls() {
			args := c.GetArgumentsJson()
			if args == "" {
				args = "{}"
			}
			mm.ToolCalls = append(mm.ToolCalls, &modelproxyv1.ToolCall{Id: c.GetId(), Name: c.GetName(), ArgsJson: args})
		}
		li.Messages = append(li.Messages, mm)
	}
	return li
}

func modelRole(r orchestratorv1.MessageRole) modelproxyv1.Role {
	switch r {
	case orchestratorv1.MessageRole_MESSAGE_ROLE_SYSTEM:
		return modelproxyv1.Role_ROLE_SYSTEM
	case orchestratorv1.MessageRole_MESSAGE_ROLE_USER:
		return modelproxyv1.Role_ROLE_USER
	case orchestratorv1.MessageRole_MESSAGE_ROLE_ASSISTANT:
		return modelproxyv1.Role_ROLE_ASSISTANT
	case orchestratorv1.MessageRole_MESSAGE_ROLE_TOOL:
		return modelproxyv1.Role_ROLE_TOOL
	}
	return modelproxyv1.Role_ROLE_UNSPECIFIED
}

// maxSteps is the service's step limit: the most a run's max_steps may ask for, and the
// limit of a run that asks for none.
func (s *Server) maxSteps() int {
	if n := s.cfg.Loop.MaxSteps; n > 0 {
		return n
	}
	return agent.DefaultMaxSteps
}
