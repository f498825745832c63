package admission

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// Reason says why a run was not admitted. It is the reason label of curfew_shed_total.
type Reason string

// Reasons. Each shed's ErrorInfo reason is "SHED_" followed by the upper-cased reason
// ("SHED_DEADLINE_SLACK").
const (
	// ReasonDeadlineSlack: the run's deadline slack is smaller than its expected service
	// time plus the cancel grace, at arrival or when it left the queue.
	ReasonDeadlineSlack Reason = "deadline_slack"
	// ReasonQueueAge: the run waited in the queue longer than the pool's MaxQueueAge.
	ReasonQueueAge Reason = "queue_age"
	// ReasonQueueFull: the pool's queue was full, or the run was a queued sheddable one
	// evicted to make room for a critical arrival.
	ReasonQueueFull Reason = "queue_full"
	// ReasonPoolClosed: the overflow pool has failed closed (ShedError.Condition says
	// which condition keeps it closed).
	ReasonPoolClosed Reason = "pool_closed"
	// ReasonTenantConcurrency: the tenant already has MaxInFlight runs admitted or queued.
	ReasonTenantConcurrency Reason = "tenant_concurrency"
	// ReasonBudget: the tenant's spent and reserved tokens plus the run's expected tokens
	// exceed its token budget for the window.
	ReasonBudget Reason = "budget"
	// ReasonRateLimited: the tenant starts runs faster than its rate.
	ReasonRateLimited Reason = "rate_limited"
	// ReasonRequestRateLimited: the tenant calls the public API faster than its request
	// rate (Controller.AllowRequest); a call, not necessarily a run, is refused.
	ReasonRequestRateLimited Reason = "request_rate_limited"
	// ReasonShutdown: the controller was closed (the service is stopping). Its status is
	// UNAVAILABLE, not RESOURCE_EXHAUSTED: the caller should go to another replica.
	ReasonShutdown Reason = "shutdown"
	// ReasonCancelled is not a shed: the run's context ended while it was queued, and
	// Admit returned the context's status (CANCELED or DEADLINE_EXCEEDED). It is counted
	// under this reason in curfew_shed_total because clients leaving the queue is the
	// signal that the queue is too slow.
	ReasonCancelled Reason = "cancelled"
)

// Reasons lists every Reason, in a fixed order.
func Reasons() []Reason {
	return []Reason{ReasonDeadlineSlack, ReasonQueueAge, ReasonQueueFull, ReasonPoolClosed,
		ReasonTenantConcurrency, ReasonBudget, ReasonRateLimited, ReasonRequestRateLimited, ReasonShutdown, ReasonCancelled}
}

// ErrorInfoReason is the reason's ErrorInfo reason: "SHED_" + upper-cased reason.
func (r Reason) ErrorInfoReason() string { return shedPrefix + strings.ToUpper(string(r)) }

const shedPrefix = "SHED_"

// Domain is the ErrorInfo domain of curfew's errors.
const Domain = "curfew.dev"

// ErrorInfo metadata keys of a shed.
const (
	MetadataPool      = "pool"
	MetadataTenant    = "tenant"
	MetadataCondition = "condition"
)

// ShedError is Admit's refusal. Its gRPC status (GRPCStatus, so status.FromError and
// status.Code work on it) is RESOURCE_EXHAUSTED (UNAVAILABLE for ReasonShutdown) with a
// google.rpc.RetryInfo carrying RetryAfter and a google.rpc.ErrorInfo {Reason:
// "SHED_<REASON>", Domain: "curfew.dev", Metadata: pool, tenant, and condition for
// pool_closed}.
type ShedError struct {
	// Reason is why the run was shed.
	Reason Reason
	// RetryAfter is when trying again makes sense: the time until the budget window or the
	// fail-closed window ends, the deadline slack left for deadline_slack (so a retry layer
	// that honours it gives up within this deadline), Config.RetryAfter otherwise. At least
	// MinRetryAfter.
	RetryAfter time.Duration
	// Pool is the pool the run asked for ("" when none was resolved).
	Pool string
	// Tenant is the run's tenant.
	Tenant string
	// Condition names the fail-closed conditions keeping the pool closed (pool_closed),
	// comma-separated ("orphan_tokens,retry_without_id").
	Condition string
	// Detail is a human explanation for the status message.
	Detail string
}

func (e *ShedError) Error() string {
	msg := fmt.Sprintf("admission: shed (%s)", e.Reason)
	if e.Pool != "" {
		msg += fmt.Sprintf(" from pool %q", e.Pool)
	}
	if e.Detail != "" {
		msg += ": " + e.Detail
	}
	return msg
}

// Code is the gRPC code of the shed: RESOURCE_EXHAUSTED, or UNAVAILABLE for shutdown.
func (e *ShedError) Code() codes.Code {
	if e.Reason == ReasonShutdown {
		return codes.Unavailable
	}
	return codes.ResourceExhausted
}

// GRPCStatus is the shed's status with its RetryInfo and ErrorInfo.
func (e *ShedError) GRPCStatus() *status.Status {
	md := map[string]string{MetadataPool: e.Pool, MetadataTenant: e.Tenant}
	if e.Condition != "" {
		md[MetadataCondition] = e.Condition
	}
	st := status.New(e.Code(), e.Error())
	withDetails, err := st.WithDetails(
		&errdetails.RetryInfo{RetryDelay: durationpb.New(e.RetryAfter)},
		&errdetails.ErrorInfo{Reason: e.Reason.ErrorInfoReason(), Domain: Domain, Metadata: md},
	)
	if err != nil { // only if the details cannot be marshalled, which they always can
		return st
	}
	return withDetails
}

// AsShed returns the shed in err: a *ShedError in err's chain, or one rebuilt from a gRPC
// status error carrying a shed's ErrorInfo (a refusal that crossed the wire; its Detail
// is then the status message).
func AsShed(err error) (*ShedError, bool) {
	var se *ShedError
	if errors.As(err, &se) {
		return se, true
	}
	st, ok := status.FromError(err)
	if !ok || err == nil {
		return nil, false
	}
	var out *ShedError
	var delay time.Duration
	for _, d := range st.Details() {
		switch d := d.(type) {
		case *errdetails.ErrorInfo:
			if d.GetDomain() == Domain && strings.HasPrefix(d.GetReason(), shedPrefix) {
				md := d.GetMetadata()
				out = &ShedError{Reason: Reason(strings.ToLower(strings.TrimPrefix(d.GetReason(), shedPrefix))),
					Pool: md[MetadataPool], Tenant: md[MetadataTenant], Condition: md[MetadataCondition], Detail: st.Message()}
			}
		case *errdetails.RetryInfo:
			delay = d.GetRetryDelay().AsDuration()
		}
	}
	if out == nil {
		return nil, false
	}
	out.RetryAfter = delay
	return out, true
}

// ctxStatus is the status error of a context that ended: CANCELED or DEADLINE_EXCEEDED.
func ctxStatus(ctx context.Context) error {
	err := ctx.Err()
	if err == nil {
		err = context.Canceled
	}
	return status.FromContextError(err).Err()
}
