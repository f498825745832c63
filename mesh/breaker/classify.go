package breaker

import (
	"context"
	"errors"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// Outcome is how a call's result counts for its target's breaker.
type Outcome int

// Outcomes.
const (
	// OutcomeSuccess: the target answered as a healthy target does. It resets the run of
	// consecutive failures, counts in the window, and closes a half-open breaker.
	OutcomeSuccess Outcome = iota
	// OutcomeFailure counts against the target.
	OutcomeFailure
	// OutcomeIgnored says nothing about the target's health: it is neither counted in the
	// window nor judged, and a half-open probe ending so frees the probe slot.
	OutcomeIgnored
)

func (o Outcome) String() string {
	switch o {
	case OutcomeSuccess:
		return "success"
	case OutcomeFailure:
		return "failure"
	case OutcomeIgnored:
		return "ignored"
	}
	return "unknown"
}

// CallerBudgetSlack is how close to the caller's deadline a DEADLINE_EXCEEDED from the
// target is still taken as the caller's own deadline: a hop reconciles the relative gRPC
// deadline with the absolute curfew-deadline within deadline.DefaultSkewTolerance, so its
// deadline can pass that much before the caller's own timer fires.
const CallerBudgetSlack = deadline.DefaultSkewTolerance

// Failure reports whether a call's outcome counts against its target: Classify(ctx, err)
// is OutcomeFailure. ctx is the caller's context of the call.
func Failure(ctx context.Context, err error) bool {
	return Classify(ctx, err) == OutcomeFailure
}

// Classify judges a call's outcome for its target's breaker; ctx is the caller's
// context of the call (nil is taken as never done, without a deadline). The rules, first
// match wins:
//
//   - nil: success.
//   - the caller's ctx is done (it cancelled, or its deadline passed): ignored, whatever
//     the error. The call ended because the caller gave up, which says nothing about the
//     target.
//   - CANCELED: ignored. A cancellation that came back from the target started above it
//     (a run cancelled, an attempt superseded); the target did not fail.
//   - DEADLINE_EXCEEDED: ignored when it is the caller's own short budget: the caller's
//     deadline is less than CallerBudgetSlack away, or the status is a hop's fast-fail
//     refusal ("no time left to ..."; the wire contract's message for "not started for
//     lack of time"). Otherwise a failure: the target gave up on its own, on a timeout or
//     capped deadline of its own, while its caller still had time.
//   - INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, UNAUTHENTICATED,
//     FAILED_PRECONDITION, OUT_OF_RANGE, UNIMPLEMENTED: success. The target answered and
//     refused the request; the request is at fault, and fencing off the target would
//     also fail every good request.
//   - ABORTED: success. In curfew it is a concurrency verdict on the request (a duplicate
//     attempt of one retry-id in flight, or one superseded), given by a healthy target.
//   - RESOURCE_EXHAUSTED with RetryInfo: ignored. A deliberate pushback (load shedding, a
//     tenant's budget): the target protects itself and said when to come back, the retry
//     layer honours it, and one tenant's spent budget must not fence off the target for
//     every tenant. So is a tenant's budget refusal (ErrorInfo BUDGET_EXHAUSTED, package
//     budget), which carries no RetryInfo so that no retry layer waits for its window.
//     Without either: failure (the target ran out of something of its
//     own: memory, a provider quota).
//   - any code carrying a relay marker, an ErrorInfo (domain curfew.dev) with reason
//     BREAKER_OPEN (a breaker below the target refused; this breaker's own refusals never
//     reach done), RETRIES_EXHAUSTED (a retry layer below retried a dependency of the
//     target to exhaustion) or DEPENDENCY_FAILED (the target says something it depends
//     on failed: see [Relay]): ignored. The target is up and relayed the failure of a
//     dependency, which is counted where it is called (by the breaker of the hop below,
//     or modelproxy's per provider); counting it here too would fence off the whole
//     target (every model, every tool) for one dependency, at every hop above it.
//   - UNAVAILABLE, INTERNAL, UNKNOWN, DATA_LOSS: failure. The target is down,
//     unreachable, overloaded, or broken.
//   - an error that is not a gRPC status: context.Canceled is ignored,
//     context.DeadlineExceeded is judged as DEADLINE_EXCEEDED above, anything else (a
//     transport error of a non-gRPC client) is a failure.
func Classify(ctx context.Context, err error) Outcome {
	if err == nil {
		return OutcomeSuccess
	}
	if ctx != nil && ctx.Err() != nil {
		return OutcomeIgnored
	}
	st, ok := status.FromError(err)
	if ok && relayed(st) {
		return OutcomeIgnored
	}
	if !ok {
		switch {
		case errors.Is(err, context.Canceled):
			return OutcomeIgnored
		case errors.Is(err, context.DeadlineExceeded):
			return deadlineOutcome(ctx, nil)
		}
		return OutcomeFailure
	}
	switch st.Code() {
	case codes.OK:
		return OutcomeSuccess
	case codes.Canceled:
		return OutcomeIgnored
	case codes.DeadlineExceeded:
		return deadlineOutcome(ctx, st)
	case codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.PermissionDenied,
		codes.Unauthenticated, codes.FailedPrecondition, codes.OutOfRange, codes.Unimplemented,
		codes.Aborted:
		return OutcomeSuccess
	case codes.ResourceExhausted:
		if hasRetryInfo(st) || budget.Refused(err) {
			return OutcomeIgnored
		}
		return OutcomeFailure
	}
	return OutcomeFailure // INTERNAL, UNKNOWN, DATA_LOSS, and any code gRPC adds later
}

// deadlineOutcome judges a DEADLINE_EXCEEDED (st nil: a context.DeadlineExceeded error)
// while the caller's ctx is not done.
func deadlineOutcome(ctx context.Context, st *status.Status) Outcome {
	if st != nil && strings.HasPrefix(st.Message(), "no time left") {
		return OutcomeIgnored
	}
	if ctx != nil {
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < CallerBudgetSlack {
			return OutcomeIgnored
		}
	}
	return OutcomeFailure
}

// relayed reports whether st carries a relay marker (see Classify).
func relayed(st *status.Status) bool {
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetDomain() == Domain {
			switch ei.GetReason() {
			case Reason, retry.ExhaustedReason, RelayedReason:
				return true
			}
		}
	}
	return false
}

// RelayedReason is the ErrorInfo reason of Relay's marker.
const RelayedReason = "DEPENDENCY_FAILED"

// Relay marks err, a status a handler returns because something it depends on failed (a
// tool's backend, a model provider behind modelproxy's own breakers), so that its
// callers' breakers for this service ignore it: the service itself is up. The code,
// message and other details are kept; a non-status err is returned as it is.
func Relay(err error) error {
	st, ok := status.FromError(err)
	if !ok || st.Code() == codes.OK || relayed(st) {
		return err
	}
	marked, derr := st.WithDetails(&errdetails.ErrorInfo{Reason: RelayedReason, Domain: Domain})
	if derr != nil {
		return err
	}
	return marked.Err()
}

func hasRetryInfo(st *status.Status) bool {
	for _, d := range st.Details() {
		if _, ok := d.(*errdetails.RetryInfo); ok {
			return true
		}
	}
	return false
}
