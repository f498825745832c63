package budget

import (
	"fmt"
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The refusal's ErrorInfo.
const (
	// Reason is the ErrorInfo reason of a call refused for its tenant's budget.
	Reason = "BUDGET_EXHAUSTED"
	// Domain is the ErrorInfo domain of curfew's errors.
	Domain = "curfew.dev"
)

// Refusal is a reservation the tenant's budget could not cover. It is a gRPC status
// (GRPCStatus): RESOURCE_EXHAUSTED with an ErrorInfo {reason BUDGET_EXHAUSTED, domain
// curfew.dev, metadata tenant, budget, spent, reserved, need, window_end (RFC 3339)}.
// It carries no RetryInfo on purpose: the call is not to be retried by a retry layer
// (the budget comes back only when the window ends, which is usually past the run's
// deadline); the run it belongs to is stopped with cause budget. Breakers ignore it
// (package breaker): one tenant's budget says nothing about the service's health.
type Refusal struct {
	Tenant                  string
	Spent, Reserved, Budget int64
	Window                  time.Duration
	Need                    int64     // what the call asked to reserve
	WindowEnd               time.Time // when the window's spend is forgotten
	// Detail, if set by the caller, says what the call needed the tokens for
	// ("prompt 12 + max_tokens 256"); it is appended to the message.
	Detail string
}

func (r *Refusal) Error() string {
	msg := fmt.Sprintf("token budget exhausted: tenant %q has spent %d and reserved %d of its %d tokens per %v; the model call needs %d",
		r.Tenant, r.Spent, r.Reserved, r.Budget, r.Window, r.Need)
	if r.Detail != "" {
		msg += " (" + r.Detail + ")"
	}
	return msg
}

// GRPCStatus is the refusal as a status, for package status.
func (r *Refusal) GRPCStatus() *status.Status {
	st := status.New(codes.ResourceExhausted, r.Error())
	ws, err := st.WithDetails(&errdetails.ErrorInfo{Reason: Reason, Domain: Domain, Metadata: map[string]string{
		"tenant": r.Tenant, "budget": strconv.FormatInt(r.Budget, 10), "spent": strconv.FormatInt(r.Spent, 10),
		"reserved": strconv.FormatInt(r.Reserved, 10), "need": strconv.FormatInt(r.Need, 10),
		"window_end": r.WindowEnd.UTC().Format(time.RFC3339),
	}})
	if err != nil {
		return st
	}
	return ws
}

// Refused reports whether err is a budget refusal: a *Refusal, or a status carrying its
// ErrorInfo (one that crossed the wire, at any hop above the one that refused).
func Refused(err error) bool {
	if err == nil {
		return false
	}
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.ResourceExhausted {
		return false
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == Reason && ei.GetDomain() == Domain {
			return true
		}
	}
	return false
}
