package source

import (
	"context"
	"encoding/json"
	"errors"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
)

// Source is one place tools come from. Its methods are safe for concurrent use.
type Source interface {
	// List returns the tools the source offers now. An error means the source is down
	// (a server not answering, a stdio process that exited): the registry keeps its
	// last list, fails the source's calls UNAVAILABLE with the error, and asks again.
	List(ctx context.Context) ([]Tool, error)
	// Call runs one tool. ctx carries the run's deadline and is cancelled with the node;
	// Call returns promptly when it is, even if the server ignores the cancel. progress,
	// never nil, receives the tool's progress reports while Call runs; a report that
	// arrives after Call returned is dropped by the source and counted as late.
	// A tool that fails in its own terms (MCP isError, ToolService is_error) is a
	// Result with IsError, not an error; an error is the call's transport or protocol
	// failure, as a gRPC status.
	Call(ctx context.Context, call Call, progress func(*meshv1.Progress)) (Result, error)
	// Changed is closed when the source's list of tools has changed (MCP's
	// notifications/tools/list_changed, a restarted server): the registry lists again
	// and asks for the next Changed. nil when the source never changes its list.
	Changed() <-chan struct{}
	// Close ends the source's sessions and processes.
	Close() error
}

// Tool is a tool as its source describes it.
type Tool struct {
	// Name is the tool's name on its source (not yet namespaced).
	Name        string
	Description string
	// InputSchema is the JSON Schema of the arguments; nil means any object.
	InputSchema json.RawMessage
	// Hints are what the source says of the tool's effects, for the registry to weigh
	// against the configuration and the source's trust.
	Hints Hints
}

// Hints are a source's claims about a tool (MCP's annotations, ToolService's
// side_effects). nil fields were not said.
type Hints struct {
	ReadOnly    *bool
	Destructive *bool
	Idempotent  *bool
	OpenWorld   *bool
}

// Call is one call of a tool: its name on the source, its arguments (a JSON object,
// already validated against the tool's input schema) and what curfew tells the tool
// about the call. A gRPC source sends Meta as curfew's metadata; an MCP source in
// _meta under the prefix MetaPrefix.
type Call struct {
	Tool string
	Args json.RawMessage
	Meta Meta
}

// Meta is what a tool learns of the call it serves.
type Meta struct {
	// Deadline is the run's absolute deadline (the node's, which is never later).
	Deadline time.Time
	RunID    string
	NodeID   string
	RetryID  string
	// Attempt is the attempt's number, from 1.
	Attempt int
	// IdempotencyKey is set when the call carries one: a tool with irreversible effects
	// must do its effect at most once per key.
	IdempotencyKey string
	// Hedge says the call is a hedged call's backup (curfew-hedge): it runs beside a
	// twin with the same RetryID, and the caller keeps the first answer.
	Hedge bool
}

// MetaPrefix prefixes the keys of curfew's facts in an MCP request's _meta.
const MetaPrefix = "curfew.dev/"

// The keys under MetaPrefix in an MCP request's _meta.
const (
	MetaDeadline       = MetaPrefix + "deadline"        // absolute Unix milliseconds
	MetaTimeoutMS      = MetaPrefix + "timeout_ms"      // milliseconds left when the call was sent
	MetaRunID          = MetaPrefix + "run_id"          // the run
	MetaNodeID         = MetaPrefix + "node_id"         // the tool's node, its path in the tree
	MetaRetryID        = MetaPrefix + "retry_id"        // the logical call, the same on every attempt
	MetaIdempotencyKey = MetaPrefix + "idempotency_key" // only when the call carries one
	MetaHedge          = MetaPrefix + "hedge"           // true on a hedged call's backup only
)

// MCPMeta returns m as the _meta of an MCP request sent at now.
func (m Meta) MCPMeta(now time.Time) map[string]any {
	out := map[string]any{MetaRunID: m.RunID, MetaNodeID: m.NodeID, MetaRetryID: m.RetryID}
	if !m.Deadline.IsZero() {
		out[MetaDeadline] = m.Deadline.UnixMilli()
		out[MetaTimeoutMS] = max(m.Deadline.Sub(now).Milliseconds(), 0)
	}
	if m.IdempotencyKey != "" {
		out[MetaIdempotencyKey] = m.IdempotencyKey
	}
	if m.Hedge {
		out[MetaHedge] = true
	}
	return out
}

// Result is a tool's answer.
type Result struct {
	// Output is the result as JSON: MCP's structuredContent when the tool gives it, else
	// its content blocks; ToolService's output_json.
	Output json.RawMessage
	// IsError says the tool failed in its own terms; Text says why.
	IsError bool
	Text    string
}

// ErrTooLarge is wrapped by a source whose server sent a message larger than its limit.
var ErrTooLarge = errors.New("message larger than the limit")
