package md

import (
	"context"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/metadata"
)

// Header names of the wire contract. gRPC metadata keys are lower case.
const (
	// Deadline is the absolute deadline in Unix milliseconds (wall clock). The gRPC
	// deadline (grpc-timeout) stays authoritative; this one is for audit, persistence
	// and clock-skew detection.
	Deadline = "curfew-deadline"
	// Tenant names the tenant the work is charged to.
	Tenant = "curfew-tenant"
	// RunID names the run the work belongs to.
	RunID = "curfew-run-id"
	// NodeID is the node's path in the run tree, for example "root/s0.t1/sub".
	NodeID = "curfew-node-id"
	// RetryID is minted once per logical call and identical on every attempt.
	RetryID = "curfew-retry-id"
	// Attempt is the 1-based attempt number of a retried call.
	Attempt = "curfew-attempt"
	// Hedge marks a hedged call's backup (package mesh/hedge): a second, concurrent
	// attempt of the same logical call (the same curfew-retry-id) that runs beside its
	// twin. The only value is HedgeBackup. The retry-id table keys a backup apart from its
	// twin, so that neither supersedes the other, and toolrunner runs it instead of joining
	// the twin's idempotency record. It is per hop: it never travels to child calls.
	Hedge = "curfew-hedge"
	// IdempotencyKey names a tool side effect so that it happens at most once.
	IdempotencyKey = "curfew-idempotency-key"
	// Criticality is the caller's criticality class (for example "critical", "sheddable").
	Criticality = "curfew-criticality"
	// Pool names the admission pool the run was admitted to ("paid", "overflow"). The
	// orchestrator sets it on the run's identity from its admission ticket, and it travels
	// to every child call like the tenant, so that modelproxy knows the pool of each
	// decoder's run (`curfew decoders drain --pool P`). Absent for a run admitted without
	// admission, or taken over from another orchestrator.
	Pool = "curfew-pool"
	// Chaos names the drill's fault switches for this request (package mesh/chaos),
	// comma-separated. A service honours it only when started with --chaos; it travels to
	// child calls like the identity headers.
	Chaos = "curfew-chaos"
	// ToolErrors is the run's tool-error policy on a tool call: ToolErrorsToModel or
	// ToolErrorsFailRun. The agent loop sets it on each of its tool calls, so that a
	// spawn_subagent call gives the nested loop its caller's policy; absent means
	// ToolErrorsToModel.
	ToolErrors = "curfew-tool-errors"
	// CancelCause, on a CancelRun, says the caller cancels because its own client went
	// away: the only value is CancelCauseClientDisconnect, and the run's cause is
	// client_disconnect instead of operator. A gateway that holds a detached run for a
	// client (the orchestrator's OpenAI front door, for a keyed request whose client left
	// and did not come back) sends it; it is forwarded to the run's owner with the cancel.
	CancelCause = "curfew-cancel-cause"
	// CancelForwarded marks a call one orchestrator forwarded to the run's owner (a
	// CancelRun, or a WatchRun the orchestrator relays from the owner): it is not
	// forwarded again, so a run that moved while the call was on its way cannot make it
	// loop.
	CancelForwarded = "curfew-cancel-forwarded"
)

// The values of the ToolErrors header.
const (
	// ToolErrorsToModel: a failed tool call's error goes back to the model.
	ToolErrorsToModel = "to_model"
	// ToolErrorsFailRun: a failed tool call fails the run.
	ToolErrorsFailRun = "fail_run"
)

// HedgeBackup is the one value of the Hedge header.
const HedgeBackup = "1"

// HedgeFrom reports whether the incoming call is a hedged call's backup (its Hedge header
// says HedgeBackup; Check refuses other values).
func HedgeFrom(ctx context.Context) bool {
	return incoming(ctx, Hedge) == HedgeBackup
}

// CancelCauseClientDisconnect is the one value of the CancelCause header.
const CancelCauseClientDisconnect = "client_disconnect"

// ToolErrorsFailsRun reports whether the incoming call's ToolErrors header says
// ToolErrorsFailRun (Check refuses values other than the two).
func ToolErrorsFailsRun(ctx context.Context) bool {
	return incoming(ctx, ToolErrors) == ToolErrorsFailRun
}

// DefaultTenant is used when a caller names no tenant.
const DefaultTenant = "default"

// Identity is the identity of a piece of work as it travels between hops.
type Identity struct {
	Tenant  string
	RunID   string
	NodeID  string
	RetryID string
	Attempt int // 0 when the caller did not say; treat as 1.
	// Chaos is the curfew-chaos header (mesh/chaos): the drill's fault switches. The
	// server chain clears it on a service started without --chaos.
	Chaos string
	// Pool is the curfew-pool header: the run's admission pool, "" when not known.
	Pool string
}

type identityKey struct{}

// WithIdentity returns a context carrying id.
func WithIdentity(ctx context.Context, id Identity) context.Context {
	return context.WithValue(ctx, identityKey{}, id)
}

// IdentityFrom returns the identity on ctx, or the zero Identity.
func IdentityFrom(ctx context.Context) Identity {
	id, _ := ctx.Value(identityKey{}).(Identity)
	return id
}

// WithNode returns a context whose identity names node as the current node, keeping
// tenant and run. Outgoing calls made with it address that node.
func WithNode(ctx context.Context, node string) context.Context {
	id := IdentityFrom(ctx)
	id.NodeID = node
	return WithIdentity(ctx, id)
}

// FromIncoming reads the identity from incoming gRPC metadata. Missing values stay empty,
// except the tenant, which defaults to DefaultTenant. It reads each header on its own
// (metadata.ValueFromIncomingContext) instead of copying the whole incoming metadata.
func FromIncoming(ctx context.Context) Identity {
	id := Identity{
		Tenant:  incoming(ctx, Tenant),
		RunID:   incoming(ctx, RunID),
		NodeID:  incoming(ctx, NodeID),
		RetryID: incoming(ctx, RetryID),
		Chaos:   incoming(ctx, Chaos),
		Pool:    incoming(ctx, Pool),
	}
	if id.Tenant == "" {
		id.Tenant = DefaultTenant
	}
	if a, err := strconv.Atoi(incoming(ctx, Attempt)); err == nil && a > 0 {
		id.Attempt = a
	}
	return id
}

// IdempotencyKeyFrom returns the curfew-idempotency-key of the incoming call, or "".
func IdempotencyKeyFrom(ctx context.Context) string {
	return incoming(ctx, IdempotencyKey)
}

// IncomingDeadline returns the curfew-deadline header of the incoming call.
func IncomingDeadline(ctx context.Context) (time.Time, bool) {
	v := incoming(ctx, Deadline)
	if v == "" {
		return time.Time{}, false
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil || ms <= 0 {
		return time.Time{}, false
	}
	return time.UnixMilli(ms), true
}

// AppendOutgoing writes the context's identity and deadline into the outgoing metadata.
// Values already set explicitly on the outgoing context win.
func AppendOutgoing(ctx context.Context) context.Context {
	var buf [12]string
	kv := AppendPairs(buf[:0], ctx)
	if len(kv) == 0 {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// AppendPairs appends to kv the key-value pairs AppendOutgoing would add to ctx's outgoing
// metadata, for a caller that adds them together with pairs of its own.
func AppendPairs(kv []string, ctx context.Context) []string { //nolint:revive // kv first, like append
	id := IdentityFrom(ctx)
	add := func(k, v string) {
		if v != "" && len(metadata.ValueFromOutgoingContext(ctx, k)) == 0 {
			kv = append(kv, k, v)
		}
	}
	add(Tenant, id.Tenant)
	add(RunID, id.RunID)
	add(NodeID, id.NodeID)
	add(Chaos, id.Chaos)
	add(Pool, id.Pool)
	if dl, ok := ctx.Deadline(); ok {
		add(Deadline, strconv.FormatInt(dl.UnixMilli(), 10))
	}
	return kv
}

// incoming returns the first value of header k of the incoming call, trimmed, or "".
func incoming(ctx context.Context, k string) string {
	v := metadata.ValueFromIncomingContext(ctx, k)
	if len(v) == 0 {
		return ""
	}
	return strings.TrimSpace(v[0])
}
