package plan

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
)

// Defaults and limits of the plan format.
const (
	DefaultTokensPerSecond = 40
	MaxTokensPerSecond     = 10000
	MaxSteps               = 64
	// MaxToolsPerStep is the fan-out limit of one step.
	MaxToolsPerStep = 16
	// MaxDepth is how deeply spawn_subagent plans may nest.
	MaxDepth = 4
	// MaxToolCalls bounds the tool calls of a whole plan, those of the subagent plans
	// nested in it included: the per-step and depth limits alone would let one plan of a
	// few kilobytes fan out into millions of calls.
	MaxToolCalls = 1024
	// MaxBytes bounds a plan's JSON, nested plans included.
	MaxBytes   = 256 << 10
	MaxTokens  = 1_000_000
	MaxSleepMS = 3_600_000
	// MinProgressMS is the shortest interval at which sleep reports its progress: a
	// report is a message on every stream up to the client, so it is not a busy loop.
	MinProgressMS = 10
)

// Built-in tool names, as plans call them. Their specs and properties are the
// catalogue's (mesh/catalog).
const (
	ToolSleep         = "sleep"
	ToolSpawnSubagent = "spawn_subagent"
	ToolDeploy        = "deploy"
	ToolFail          = "fail"
	// ToolKVPut and ToolNotify have side effects kept in toolrunner's durable store: they
	// happen once per idempotency key (the caller's, or one derived from run, node, tool
	// and arguments), so they are always safe to retry.
	ToolKVPut  = "kv_put"
	ToolNotify = "notify"
)

// Limits of the durable built-ins' arguments.
const (
	MaxKVKeyLen        = 256
	MaxKVValueBytes    = 64 << 10
	MaxNotifyBytes     = 16 << 10
	DefaultNotifyGrace = 500 // ms
)

// Plan scripts the sim model.
type Plan struct {
	// TokensPerSecond is the decode rate; DefaultTokensPerSecond when 0.
	TokensPerSecond float64 `json:"tokens_per_second,omitempty"`
	Steps           []Step  `json:"steps"`
	// Prompt is fixture text the task carries as its prompt (`curfew drill`'s 800-token
	// fixture); the sim model does not read it.
	Prompt string `json:"prompt,omitempty"`
}

// Step is one model turn: decode ThinkTokens then call Tools in parallel, or decode
// AnswerTokens and end the loop.
type Step struct {
	ThinkTokens  int    `json:"think_tokens,omitempty"`
	AnswerTokens int    `json:"answer_tokens,omitempty"`
	Tools        []Tool `json:"tools,omitempty"`
	// FirstTokenDelayMS delays the step's first token (a slow provider).
	FirstTokenDelayMS int `json:"first_token_delay_ms,omitempty"`
	// ModelError makes the step's model call fail on its first Attempts attempts.
	ModelError *Fault `json:"model_error,omitempty"`
}

// Fault is an injected failure: the first Attempts attempts fail with Code.
type Fault struct {
	Attempts int `json:"attempts,omitempty"`
	// Rate fails each attempt with this probability (0 to 1), beyond the first Attempts.
	Rate float64 `json:"rate,omitempty"`
	Code string  `json:"code,omitempty"` // default UNAVAILABLE
}

// Fails reports whether attempt (1-based) fails: always within the first Attempts, else
// with probability Rate, drawn from rnd in [0, 1).
func (f *Fault) Fails(attempt int, rnd func() float64) bool {
	if f == nil {
		return false
	}
	return attempt <= f.Attempts || (f.Rate > 0 && rnd() < f.Rate)
}

// Tool is one tool call of a step.
type Tool struct {
	Name string          `json:"name"`
	Args json.RawMessage `json:"args,omitempty"`
	// IdempotencyKey, for a tool with side effects, lets the call be retried with its
	// effect still happening once. Without it such a call is never retried.
	IdempotencyKey string `json:"idempotency_key,omitempty"`
	// Approval makes this call wait for a human's approval before its effect, whatever
	// the tool registry says (docs/operations.md, "Approval gates").
	Approval bool `json:"approval,omitempty"`
}

// CallID is the id the sim model gives the j-th tool call of the plan's step i.
func CallID(step, j int) string { return fmt.Sprintf("call_%d_%d", step, j) }

// Approvals returns the ids (CallID) of the tool calls the plan marks "approval": true,
// nil for none or for a task that is not a valid plan. Only the plan's own steps count: a
// nested plan (spawn_subagent's) is the subagent's loop's to read.
func Approvals(task string) map[string]bool {
	if !LooksLikePlan(task) {
		return nil
	}
	p, err := Parse([]byte(task))
	if err != nil {
		return nil
	}
	var out map[string]bool
	for i, st := range p.Steps {
		for j, t := range st.Tools {
			if t.Approval {
				if out == nil {
					out = map[string]bool{}
				}
				out[CallID(i, j)] = true
			}
		}
	}
	return out
}

// MaxKeyLen bounds an idempotency key.
const MaxKeyLen = 128

// KVPutArgs are the arguments of kv_put: write Value (any JSON) under Key in the
// tenant's key-value table.
type KVPutArgs struct {
	Key   string          `json:"key"`
	Value json.RawMessage `json:"value"`
}

// NotifyArgs are the arguments of notify: append Message to the tenant's outbox on
// Channel. It is irreversible, so it never fires once its node is cancelled, nor with
// less time left than GraceMS (DefaultNotifyGrace when 0).
type NotifyArgs struct {
	Channel string `json:"channel"`
	Message string `json:"message"`
	GraceMS int    `json:"grace_ms,omitempty"`
}

// SleepArgs are the arguments of the sleep tool.
type SleepArgs struct {
	MS int `json:"ms"`
	// ProgressMS, when not 0, reports the progress every ProgressMS while sleeping: how
	// many of the MS milliseconds have passed (a demo and test source of node events).
	ProgressMS int `json:"progress_ms,omitempty"`
}

// DeployArgs are the arguments of the deploy tool: a job that takes DurationMS, polled
// every PollMS; on cancel it is aborted, which takes AbortMS, within CleanupMS (the
// cleanup budget, default 5000). FailAttempts injects a failure after the side effect:
// the job starts, then the call fails UNAVAILABLE on its first FailAttempts attempts, as
// when the ack is lost.
type DeployArgs struct {
	DurationMS   int `json:"duration_ms"`
	PollMS       int `json:"poll_ms,omitempty"`
	AbortMS      int `json:"abort_ms,omitempty"`
	CleanupMS    int `json:"cleanup_ms,omitempty"`
	FailAttempts int `json:"fail_attempts,omitempty"`
}

// FailArgs are the arguments of the fail tool: fail the first Times attempts (default 1)
// with Code (default UNAVAILABLE) after AfterMS.
type FailArgs struct {
	Times   int    `json:"times,omitempty"`
	Code    string `json:"code,omitempty"`
	AfterMS int    `json:"after_ms,omitempty"`
	// PushbackMS, when set, sends the grpc-retry-pushback-ms trailer with the failure: the
	// caller waits that long before retrying; -1 says "don't retry".
	PushbackMS *int `json:"pushback_ms,omitempty"`
	// RetryInfoMS, when set, attaches a google.rpc.RetryInfo detail with that delay.
	RetryInfoMS *int `json:"retry_info_ms,omitempty"`
	// Rate, when set, makes each attempt fail with this probability instead (0 to 1);
	// Times then counts only attempts that always fail (default 0).
	Rate float64 `json:"rate,omitempty"`
}

// SpawnArgs are the arguments of spawn_subagent: a task (or, for the sim model, a
// plan), and the nested loop's run input.
type SpawnArgs struct {
	// Task is the nested loop's user message; with the sim model, a JSON plan.
	Task string `json:"task,omitempty"`
	// Plan is a sim plan given as a JSON object, the task of a sim subagent; not with Task.
	Plan json.RawMessage `json:"plan,omitempty"`
	// Model is the nested loop's model; the subagent service's default when empty.
	Model string `json:"model,omitempty"`
	// Tools, when not empty, are the only tools the nested loop may use.
	Tools []string `json:"tools,omitempty"`
	// MaxTokens bounds each of the nested loop's model steps; 0: the provider's default.
	MaxTokens int32 `json:"max_tokens,omitempty"`
	// Reserve is the nested loop's own deadline reserve, the time it keeps for its final
	// answer (see ParseReserve and docs/reserve.md).
	Reserve string `json:"reserve,omitempty"`
}

// SpawnTask is the task a spawn_subagent call's nested loop runs: Task, or the plan.
func (a SpawnArgs) SpawnTask() string {
	if a.Task != "" {
		return a.Task
	}
	return string(a.Plan)
}

// Limits of spawn_subagent's arguments.
const (
	MaxModelNameLen = 128
	MaxSpawnTools   = 64
	MaxToolNameLen  = 128
)

// Reserve is the time an agent loop keeps for its final answer (docs/reserve.md): a fixed
// duration, or a fraction of the time left when it starts.
type Reserve struct {
	Duration time.Duration
	Fraction float64
}

// ParseReserve parses a reserve: a Go duration ("2s", "500ms"), more than 0 and at most
// MaxSleepMS, or a fraction of the time left ("0.2"), in (0, 1). Empty is no reserve.
func ParseReserve(s string) (Reserve, error) {
	if s == "" {
		return Reserve{}, nil
	}
	if f, err := strconv.ParseFloat(s, 64); err == nil {
		if !(f > 0 && f < 1) {
			return Reserve{}, fmt.Errorf("a fraction of the time left must be in (0, 1), got %q", s)
		}
		return Reserve{Fraction: f}, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return Reserve{}, fmt.Errorf(`must be a duration ("2s") or a fraction of the time left ("0.2"), got %q`, s)
	}
	if d <= 0 || d > MaxSleepMS*time.Millisecond {
		return Reserve{}, fmt.Errorf("a duration must be more than 0 and at most %v, got %q", MaxSleepMS*time.Millisecond, s)
	}
	return Reserve{Duration: d}, nil
}

// Deadline returns the deadline of the work of a loop started at now under deadline
// caller (its tools and subagents): the caller's minus the reserve, never later.
func (r Reserve) Deadline(caller, now time.Time) time.Time {
	cut := r.Duration
	if r.Fraction > 0 {
		cut = time.Duration(float64(caller.Sub(now)) * r.Fraction)
	}
	if cut <= 0 {
		return caller
	}
	return caller.Add(-cut)
}

// Error is a validation error naming the bad field.
type Error struct {
	Path string
	Msg  string
}

func (e *Error) Error() string {
	if e.Path == "" {
		return "plan: " + e.Msg
	}
	return "plan: " + e.Path + ": " + e.Msg
}

// LooksLikePlan reports whether a task is meant as a JSON plan (it starts with '{').
func LooksLikePlan(task string) bool {
	return strings.HasPrefix(strings.TrimSpace(task), "{")
}

// Parse decodes and validates a plan at nesting depth 0.
func Parse(data []byte) (*Plan, error) {
	if len(data) > MaxBytes {
		return nil, &Error{"", fmt.Sprintf("at most %d bytes, got %d", MaxBytes, len(data))}
	}
	calls := MaxToolCalls
	return parse(data, "", 0, &calls)
}

// TPS returns the plan's decode rate.
func (p *Plan) TPS() float64 {
	if p.TokensPerSecond == 0 {
		return DefaultTokensPerSecond
	}
	return p.TokensPerSecond
}

// parse decodes and validates the plan at path, nested depth deep; calls is what is
// left of the whole plan's MaxToolCalls.
func parse(data []byte, path string, depth int, calls *int) (*Plan, error) {
	if depth > MaxDepth {
		return nil, &Error{path, fmt.Sprintf("subagent plans nest deeper than %d", MaxDepth)}
	}
	var raw struct {
		TokensPerSecond *float64          `json:"tokens_per_second"`
		Steps           []json.RawMessage `json:"steps"`
		Prompt          string            `json:"prompt"`
	}
	if err := strict(data, &raw, path); err != nil {
		return nil, err
	}
	p := &Plan{Prompt: raw.Prompt}
	if raw.TokensPerSecond != nil {
		tps := *raw.TokensPerSecond
		if tps <= 0 || tps > MaxTokensPerSecond {
			return nil, &Error{join(path, "tokens_per_second"), fmt.Sprintf("must be in (0, %d], got %v", MaxTokensPerSecond, tps)}
		}
		p.TokensPerSecond = tps
	}
	if len(raw.Steps) == 0 {
		return nil, &Error{join(path, "steps"), "must have at least one step"}
	}
	if len(raw.Steps) > MaxSteps {
		return nil, &Error{join(path, "steps"), fmt.Sprintf("at most %d steps, got %d", MaxSteps, len(raw.Steps))}
	}
	for i, rs := range raw.Steps {
		sp := fmt.Sprintf("%s[%d]", join(path, "steps"), i)
		var s Step
		if err := strict(rs, &s, sp); err != nil {
			return nil, err
		}
		last := i == len(raw.Steps)-1
		switch {
		case s.ThinkTokens < 0 || s.ThinkTokens > MaxTokens:
			return nil, &Error{sp + ".think_tokens", fmt.Sprintf("must be between 0 and %d", MaxTokens)}
		case s.AnswerTokens < 0 || s.AnswerTokens > MaxTokens:
			return nil, &Error{sp + ".answer_tokens", fmt.Sprintf("must be between 0 and %d", MaxTokens)}
		case s.FirstTokenDelayMS < 0 || s.FirstTokenDelayMS > MaxSleepMS:
			return nil, &Error{sp + ".first_token_delay_ms", fmt.Sprintf("must be between 0 and %d", MaxSleepMS)}
		case last && len(s.Tools) > 0:
			return nil, &Error{sp + ".tools", "the last step answers and cannot call tools; add a step with answer_tokens"}
		case last && s.AnswerTokens == 0:
			return nil, &Error{sp + ".answer_tokens", "the last step must answer (answer_tokens > 0)"}
		case !last && s.AnswerTokens > 0:
			return nil, &Error{sp + ".answer_tokens", "only the last step answers"}
		case len(s.Tools) > MaxToolsPerStep:
			return nil, &Error{sp + ".tools", fmt.Sprintf("at most %d tools per step (fan-out limit), got %d", MaxToolsPerStep, len(s.Tools))}
		}
		if f := s.ModelError; f != nil {
			if f.Attempts < 0 || f.Attempts > 100 || (f.Attempts == 0 && f.Rate == 0) {
				return nil, &Error{sp + ".model_error.attempts", "must be between 1 and 100 (or 0 with a rate)"}
			}
			if f.Rate < 0 || f.Rate > 1 {
				return nil, &Error{sp + ".model_error.rate", "must be between 0 and 1"}
			}
			if f.Code != "" {
				if _, err := ParseCode(f.Code); err != nil {
					return nil, &Error{sp + ".model_error.code", err.Error()}
				}
			}
		}
		if *calls -= len(s.Tools); *calls < 0 {
			return nil, &Error{sp + ".tools", fmt.Sprintf("the plan calls more than %d tools in all, nested plans included", MaxToolCalls)}
		}
		for j, t := range s.Tools {
			if err := validateTool(t, fmt.Sprintf("%s.tools[%d]", sp, j), depth, calls); err != nil {
				return nil, err
			}
		}
		p.Steps = append(p.Steps, s)
	}
	return p, nil
}

// ValidateTool checks a tool call's name and arguments as a plan would, with errors
// naming the field under "args": a built-in's strictly; a tool source's (IsSourceTool)
// only for an object of arguments.
func ValidateTool(name string, args []byte) error {
	calls := MaxToolCalls
	return validateTool(Tool{Name: name, Args: args}, "", 0, &calls)
}

func validateTool(t Tool, path string, depth int, calls *int) error {
	ap := join(path, "args")
	if k := t.IdempotencyKey; len(k) > MaxKeyLen || strings.ContainsFunc(k, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return &Error{join(path, "idempotency_key"), fmt.Sprintf("at most %d printable characters", MaxKeyLen)}
	}
	switch t.Name {
	case ToolSleep:
		var a SleepArgs
		if err := strict(t.Args, &a, ap); err != nil {
			return err
		}
		if a.MS < 1 || a.MS > MaxSleepMS {
			return &Error{ap + ".ms", fmt.Sprintf("must be between 1 and %d", MaxSleepMS)}
		}
		if p := a.ProgressMS; p != 0 && (p < MinProgressMS || p > MaxSleepMS) {
			return &Error{ap + ".progress_ms", fmt.Sprintf("must be 0 (no progress) or between %d and %d", MinProgressMS, MaxSleepMS)}
		}
	case ToolDeploy:
		var a DeployArgs
		if err := strict(t.Args, &a, ap); err != nil {
			return err
		}
		for _, f := range []struct {
			name  string
			v, lo int
		}{{"duration_ms", a.DurationMS, 1}, {"poll_ms", a.PollMS, 0}, {"abort_ms", a.AbortMS, 0}, {"cleanup_ms", a.CleanupMS, 0}, {"fail_attempts", a.FailAttempts, 0}} {
			if f.v < f.lo || f.v > MaxSleepMS {
				return &Error{ap + "." + f.name, fmt.Sprintf("must be between %d and %d", f.lo, MaxSleepMS)}
			}
		}
	case ToolFail:
		var a FailArgs
		if err := strict(t.Args, &a, ap); err != nil {
			return err
		}
		if a.Times < 0 || a.Times > 100 {
			return &Error{ap + ".times", "must be between 0 and 100"}
		}
		if a.Rate < 0 || a.Rate > 1 {
			return &Error{ap + ".rate", "must be between 0 and 1"}
		}
		if a.AfterMS < 0 || a.AfterMS > MaxSleepMS {
			return &Error{ap + ".after_ms", fmt.Sprintf("must be between 0 and %d", MaxSleepMS)}
		}
		if p := a.PushbackMS; p != nil && (*p < -1 || *p > MaxSleepMS) {
			return &Error{ap + ".pushback_ms", fmt.Sprintf("must be -1 (don't retry) or between 0 and %d", MaxSleepMS)}
		}
		if p := a.RetryInfoMS; p != nil && (*p < 0 || *p > MaxSleepMS) {
			return &Error{ap + ".retry_info_ms", fmt.Sprintf("must be between 0 and %d", MaxSleepMS)}
		}
		if a.Code != "" {
			if _, err := ParseCode(a.Code); err != nil {
				return &Error{ap + ".code", err.Error()}
			}
		}
	case ToolKVPut:
		var a KVPutArgs
		if err := strict(t.Args, &a, ap); err != nil {
			return err
		}
		if a.Key == "" || len(a.Key) > MaxKVKeyLen || strings.ContainsFunc(a.Key, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			return &Error{ap + ".key", fmt.Sprintf("1 to %d printable characters", MaxKVKeyLen)}
		}
		if len(a.Value) == 0 {
			return &Error{ap + ".value", "is required (any JSON value)"}
		}
		if len(a.Value) > MaxKVValueBytes {
			return &Error{ap + ".value", fmt.Sprintf("at most %d bytes", MaxKVValueBytes)}
		}
	case ToolNotify:
		var a NotifyArgs
		if err := strict(t.Args, &a, ap); err != nil {
			return err
		}
		if a.Channel == "" || len(a.Channel) > MaxKVKeyLen {
			return &Error{ap + ".channel", fmt.Sprintf("1 to %d characters", MaxKVKeyLen)}
		}
		if len(a.Message) > MaxNotifyBytes {
			return &Error{ap + ".message", fmt.Sprintf("at most %d bytes", MaxNotifyBytes)}
		}
		if a.GraceMS < 0 || a.GraceMS > MaxSleepMS {
			return &Error{ap + ".grace_ms", fmt.Sprintf("must be between 0 and %d", MaxSleepMS)}
		}
	case ToolSpawnSubagent:
		var a SpawnArgs
		if err := strict(t.Args, &a, ap); err != nil {
			return err
		}
		if err := validateSpawn(a, ap, depth, calls); err != nil {
			return err
		}
	case "":
		return &Error{join(path, "name"), "is required"}
	default:
		if !IsSourceTool(t.Name) {
			return &Error{join(path, "name"), fmt.Sprintf("unknown tool %q (known: deploy, fail, kv_put, notify, sleep, spawn_subagent, or a tool source's source__tool)", t.Name)}
		}
		// A tool of a source: its arguments are checked against its schema by toolrunner,
		// which alone knows it (and refuses a name it does not have, NOT_FOUND).
		if a := bytes.TrimSpace(t.Args); len(a) > 0 && a[0] != '{' {
			return &Error{ap, "must be a JSON object"}
		}
		var obj map[string]json.RawMessage
		if err := strict(t.Args, &obj, ap); err != nil {
			return err
		}
	}
	return nil
}

// validateSpawn checks spawn_subagent's arguments at path ap.
func validateSpawn(a SpawnArgs, ap string, depth int, calls *int) error {
	hasPlan := len(a.Plan) > 0 && string(bytes.TrimSpace(a.Plan)) != "null"
	switch {
	case hasPlan && a.Task != "":
		return &Error{ap + ".task", "give either task or plan, not both"}
	case !hasPlan && strings.TrimSpace(a.Task) == "":
		return &Error{ap + ".task", "is required (or, for the sim model, plan)"}
	case len(a.Task) > MaxBytes:
		return &Error{ap + ".task", fmt.Sprintf("at most %d bytes, got %d", MaxBytes, len(a.Task))}
	}
	if hasPlan {
		if _, err := parse(a.Plan, ap+".plan", depth+1, calls); err != nil {
			return err
		}
	}
	if len(a.Model) > MaxModelNameLen || strings.ContainsFunc(a.Model, func(r rune) bool { return r <= 0x20 || r == 0x7f }) {
		return &Error{ap + ".model", fmt.Sprintf("at most %d characters, without spaces or control characters", MaxModelNameLen)}
	}
	if len(a.Tools) > MaxSpawnTools {
		return &Error{ap + ".tools", fmt.Sprintf("at most %d tools, got %d", MaxSpawnTools, len(a.Tools))}
	}
	for i, n := range a.Tools {
		if n == "" || len(n) > MaxToolNameLen {
			return &Error{fmt.Sprintf("%s.tools[%d]", ap, i), fmt.Sprintf("a tool name of 1 to %d characters", MaxToolNameLen)}
		}
	}
	if a.MaxTokens < 0 || a.MaxTokens > MaxTokens {
		return &Error{ap + ".max_tokens", fmt.Sprintf("must be between 0 (the provider's default) and %d, got %d", MaxTokens, a.MaxTokens)}
	}
	if _, err := ParseReserve(a.Reserve); err != nil {
		return &Error{ap + ".reserve", err.Error()}
	}
	return nil
}

// SourceToolSeparator separates a tool source's name from its tool's in the names
// models and plans call source tools by (toolrunner's registry, docs/tools.md).
const SourceToolSeparator = "__"

// IsSourceTool reports whether name has the shape of a tool source's tool: source__tool,
// 1 to 64 of [a-zA-Z0-9_-]. Whether the tool exists only toolrunner knows. A name without
// the separator is a built-in's, checked as such.
func IsSourceTool(name string) bool {
	if len(name) > 64 || !strings.Contains(name, SourceToolSeparator) || strings.HasPrefix(name, SourceToolSeparator) {
		return false
	}
	for _, r := range name {
		if r != '_' && r != '-' && (r < 'a' || r > 'z') && (r < 'A' || r > 'Z') && (r < '0' || r > '9') {
			return false
		}
	}
	return true
}

// Args decodes a built-in tool's arguments strictly into v.
func Args(raw []byte, v any) error {
	if len(bytes.TrimSpace(raw)) == 0 {
		raw = []byte("{}")
	}
	return strict(raw, v, "args")
}

func strict(data []byte, v any, path string) error {
	if len(bytes.TrimSpace(data)) == 0 {
		data = []byte("{}")
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var te *json.UnmarshalTypeError
		var se *json.SyntaxError
		switch {
		case errors.As(err, &te):
			return &Error{join(path, te.Field), fmt.Sprintf("must be %s, got %s", te.Type, te.Value)}
		case errors.As(err, &se):
			return &Error{path, fmt.Sprintf("invalid JSON at offset %d: %v", se.Offset, err)}
		case errors.Is(err, io.ErrUnexpectedEOF):
			return &Error{path, "invalid JSON: it ends before the object is complete"}
		case strings.HasPrefix(err.Error(), "json: unknown field "):
			return &Error{path, "unknown field " + strings.TrimPrefix(err.Error(), "json: unknown field ")}
		}
		return &Error{path, err.Error()}
	}
	if dec.More() {
		return &Error{path, "trailing data after the JSON object"}
	}
	return nil
}

func join(path, field string) string {
	if path == "" {
		return field
	}
	if field == "" {
		return path
	}
	return path + "." + field
}

// ParseCode parses a gRPC code name such as "UNAVAILABLE" or "unavailable".
func ParseCode(s string) (codes.Code, error) {
	var c codes.Code
	if err := c.UnmarshalJSON([]byte(`"` + strings.ToUpper(s) + `"`)); err != nil {
		return 0, fmt.Errorf("unknown gRPC code %q", s)
	}
	if c == codes.OK {
		return 0, fmt.Errorf("code must not be OK")
	}
	return c, nil
}
