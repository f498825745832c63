package tracing

import (
	"context"
	"strconv"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// Span attribute keys curfew adds (docs/tracing.md lists them).
const (
	// RunID is the run the span's work belongs to (curfew-run-id).
	RunID = attribute.Key("curfew.run_id")
	// NodeID is the node's path in the run tree (curfew-node-id); on a client span the
	// node the call executes.
	NodeID = attribute.Key("curfew.node_id")
	// Tenant is the tenant the work is charged to (curfew-tenant).
	Tenant = attribute.Key("curfew.tenant")
	// RetryID is the logical call's retry-id, the same on every attempt (curfew-retry-id).
	RetryID = attribute.Key("curfew.retry_id")
	// Attempt is the 1-based attempt number of the call (curfew-attempt).
	Attempt = attribute.Key("curfew.attempt")
	// CancelCause is why a cancelled node or call stopped: client_disconnect, deadline,
	// operator, sibling_failed, superseded or budget. Absent when the cause is unknown
	// where the span was recorded (a cancel that arrived as a bare RST_STREAM).
	CancelCause = attribute.Key("curfew.cancel_cause")
	// NodeStatus is a node's final status: succeeded, failed, cancelled, deadline_exceeded.
	NodeStatus = attribute.Key("curfew.node_status")
	// Tokens are the tokens a model call emitted (modelproxy's ledger), or a run's total.
	Tokens = attribute.Key("curfew.tokens")
	// TokensAfterCancel are the tokens emitted after the cancel instant: on a model call
	// the instant its context was cancelled there, on a run the run's cancel instant.
	TokensAfterCancel = attribute.Key("curfew.tokens_after_cancel")
)

// identityKeys are the metadata headers copied onto RPC spans, with their attributes.
var identityKeys = [...]struct {
	header string
	key    attribute.Key
}{
	{md.RunID, RunID}, {md.NodeID, NodeID}, {md.Tenant, Tenant}, {md.RetryID, RetryID},
}

// identityAttrs appends the attributes of the curfew-* values get returns.
func identityAttrs(kv []attribute.KeyValue, ctx context.Context, get func(context.Context, string) []string) []attribute.KeyValue { //nolint:revive // kv first, like append
	for _, k := range identityKeys {
		if v := get(ctx, k.header); len(v) > 0 && v[0] != "" {
			kv = append(kv, k.key.String(v[0]))
		}
	}
	if v := get(ctx, md.Attempt); len(v) > 0 {
		if a, err := strconv.Atoi(v[0]); err == nil && a > 0 {
			kv = append(kv, Attempt.Int(a))
		}
	}
	return kv
}

// IdentityAttrs returns the attributes of an identity (empty values left out).
func IdentityAttrs(id md.Identity) []attribute.KeyValue {
	kv := make([]attribute.KeyValue, 0, 5)
	for _, a := range [...]struct {
		k attribute.Key
		v string
	}{{RunID, id.RunID}, {NodeID, id.NodeID}, {Tenant, id.Tenant}, {RetryID, id.RetryID}} {
		if a.v != "" {
			kv = append(kv, a.k.String(a.v))
		}
	}
	if id.Attempt > 0 {
		kv = append(kv, Attempt.Int(id.Attempt))
	}
	return kv
}

// EndNode records a node's outcome on span: its status, its cancel cause when known, and
// an error status when it failed. It does nothing when span is not recording.
func EndNode(span trace.Span, st meshv1.NodeStatus, cause meshv1.CancelCause, errCode, errMsg string) {
	if !span.IsRecording() {
		return
	}
	kv := make([]attribute.KeyValue, 0, 2)
	kv = append(kv, NodeStatus.String(statusName(st)))
	if c := cancel.Name(cause); c != "" {
		kv = append(kv, CancelCause.String(c))
	}
	span.SetAttributes(kv...)
	if st == meshv1.NodeStatus_NODE_STATUS_FAILED {
		span.SetStatus(codes.Error, errCode+": "+errMsg)
	}
}

// statusName is the lower-case name of a node status ("deadline_exceeded").
func statusName(st meshv1.NodeStatus) string {
	return strings.ToLower(strings.TrimPrefix(st.String(), "NODE_STATUS_"))
}
