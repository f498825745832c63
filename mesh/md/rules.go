package md

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// Limits of the wire contract's header values (docs/api.md, "Metadata"). Every hop
// refuses a value outside them with INVALID_ARGUMENT before any work starts (Check).
const (
	// MaxIDLen bounds curfew-run-id and curfew-retry-id.
	MaxIDLen = 128
	// MaxNodeIDLen bounds curfew-node-id, a path of IDs.
	MaxNodeIDLen = 512
	// MaxTenantLen bounds curfew-tenant.
	MaxTenantLen = 64
	// MaxPoolLen bounds curfew-pool (admission's pool names are shorter still).
	MaxPoolLen = 64
	// MaxIdempotencyKeyLen bounds curfew-idempotency-key.
	MaxIdempotencyKeyLen = 256
	// MaxAttempt is the largest curfew-attempt: far above any retry policy (curfew's own
	// stops at 5), it bounds the value without refusing a patient caller's retries.
	MaxAttempt = 100
	// MinDeadlineMS and MaxDeadlineMS bound curfew-deadline in Unix milliseconds
	// (2001-09-09 and 2286-11-20 UTC): thirteen digits, so that a value in seconds or in
	// microseconds is refused instead of read as a deadline decades away or long past.
	MinDeadlineMS = 1_000_000_000_000
	MaxDeadlineMS = 9_999_999_999_999
)

// rule is one header's check: nil when v (trimmed, non-empty) is well-formed, else what
// the value must be.
type rule struct {
	header string
	check  func(v string) error
}

// rules are the checks of Check, one per header, in the order they are reported.
var rules = []rule{
	{Deadline, checkDeadline},
	{Tenant, checkTenant},
	{Pool, checkPool},
	{RunID, checkID},
	{NodeID, checkNodeID},
	{RetryID, checkID},
	{Attempt, checkAttempt},
	{Hedge, checkHedge},
	{IdempotencyKey, checkIdempotencyKey},
	{ToolErrors, checkToolErrors},
	{CancelCause, checkCancelCause},
}

// Check applies the wire contract's rules to the incoming call's curfew-* headers. A
// header sent more than once, or whose value breaks its rule, is INVALID_ARGUMENT with a
// message that names the header and the rule. A header that is absent or empty is not
// checked (its default applies). Values are trimmed of surrounding spaces, as
// FromIncoming reads them.
//
// A well-formed curfew-attempt without a curfew-retry-id is not refused here: it is a
// retry that lost its retry-id, which the orchestrator's admission answers by closing the
// overflow pool (seed 003's fault 3, admission.ConditionRetryWithoutID), so that operators
// see the signal while paid work goes on.
func Check(ctx context.Context) error {
	for _, r := range rules {
		vs := metadata.ValueFromIncomingContext(ctx, r.header)
		if len(vs) == 0 {
			continue
		}
		if len(vs) > 1 {
			return invalid(r.header, fmt.Sprintf("sent %d times; send it once", len(vs)))
		}
		v := strings.TrimSpace(vs[0])
		if v == "" {
			continue
		}
		if err := r.check(v); err != nil {
			return invalid(r.header, err.Error())
		}
	}
	return nil
}

// InvalidHeader reports whether err is Check's refusal, and names the header.
func InvalidHeader(err error) (string, bool) {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.InvalidArgument {
		return "", false
	}
	for _, r := range rules {
		if strings.HasPrefix(st.Message(), "invalid "+r.header+": ") {
			return r.header, true
		}
	}
	return "", false
}

func invalid(header, why string) error {
	return status.Errorf(codes.InvalidArgument, "invalid %s: %s", header, why)
}

func checkDeadline(v string) error {
	if !allDigits(v) {
		return fmt.Errorf("must be an integer of Unix milliseconds, got %q", clip(v))
	}
	ms, err := strconv.ParseInt(v, 10, 64)
	if err != nil || ms < MinDeadlineMS || ms > MaxDeadlineMS {
		return fmt.Errorf("must be Unix milliseconds from %d to %d, got %s", int64(MinDeadlineMS), int64(MaxDeadlineMS), clip(v))
	}
	return nil
}

func checkAttempt(v string) error {
	n, err := strconv.Atoi(v)
	if err != nil || !allDigits(v) || n < 1 || n > MaxAttempt {
		return fmt.Errorf("must be an integer from 1 to %d, got %q", MaxAttempt, clip(v))
	}
	return nil
}

func checkHedge(v string) error {
	if v != HedgeBackup {
		return fmt.Errorf("must be %q, got %q", HedgeBackup, clip(v))
	}
	return nil
}

// checkID is the rule of curfew-run-id and curfew-retry-id: 1 to MaxIDLen characters of
// letters, digits and . _ : - (a UUID is one).
func checkID(v string) error {
	if len(v) > MaxIDLen || !idChars(v) {
		return fmt.Errorf("must be 1 to %d characters of A-Z a-z 0-9 . _ : - (a UUID, say), got %q", MaxIDLen, clip(v))
	}
	return nil
}

// checkNodeID is the rule of curfew-node-id: a path of IDs separated by '/', at most
// MaxNodeIDLen long, with no empty, "." or ".." element ("root/s0.t1/sub").
func checkNodeID(v string) error {
	ok := len(v) <= MaxNodeIDLen
	for _, p := range strings.Split(v, "/") {
		ok = ok && p != "." && p != ".." && len(p) <= MaxIDLen && idChars(p)
	}
	if !ok {
		return fmt.Errorf("must be a path of IDs (A-Z a-z 0-9 . _ : -) separated by '/', at most %d characters, without empty, . or .. elements, got %q", MaxNodeIDLen, clip(v))
	}
	return nil
}

// checkTenant is the rule of curfew-tenant: 1 to MaxTenantLen characters of letters,
// digits and . _ - (the names `curfew tenant create` accepts).
func checkTenant(v string) error {
	if !ValidTenant(v) {
		return fmt.Errorf("must be 1 to %d characters of A-Z a-z 0-9 . _ -, got %q", MaxTenantLen, clip(v))
	}
	return nil
}

// checkPool is the rule of curfew-pool: 1 to MaxPoolLen characters of the tenant's
// charset (A-Z a-z 0-9 . _ -); admission's pool names are a subset.
func checkPool(v string) error {
	if !ValidPool(v) {
		return fmt.Errorf("must be 1 to %d characters of A-Z a-z 0-9 . _ -, got %q", MaxPoolLen, clip(v))
	}
	return nil
}

// ValidPool reports whether s is a well-formed curfew-pool value.
func ValidPool(s string) bool { return len(s) <= MaxPoolLen && nameChars(s) }

// ValidTenant reports whether s is a well-formed tenant name.
func ValidTenant(s string) bool { return len(s) <= MaxTenantLen && nameChars(s) }

// nameChars reports whether s is non-empty and made of A-Z a-z 0-9 . _ - only.
func nameChars(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !alnum(c) && c != '.' && c != '_' && c != '-' {
			return false
		}
	}
	return true
}

// checkIdempotencyKey is the rule of curfew-idempotency-key: 1 to MaxIdempotencyKeyLen
// printable ASCII characters without spaces.
func checkIdempotencyKey(v string) error {
	ok := len(v) <= MaxIdempotencyKeyLen
	for i := 0; ok && i < len(v); i++ {
		ok = v[i] > ' ' && v[i] < 0x7f
	}
	if !ok {
		return fmt.Errorf("must be 1 to %d printable ASCII characters without spaces, got %q", MaxIdempotencyKeyLen, clip(v))
	}
	return nil
}

func idChars(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !alnum(c) && c != '.' && c != '_' && c != ':' && c != '-' {
			return false
		}
	}
	return true
}

func alnum(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' }

func allDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return s != ""
}

// clip shortens a refused value for the error message: a caller's mistake is echoed, a
// megabyte of it is not.
func clip(v string) string {
	const n = 64
	if len(v) <= n {
		return v
	}
	return v[:n] + "…"
}

func checkToolErrors(v string) error {
	if v != ToolErrorsToModel && v != ToolErrorsFailRun {
		return fmt.Errorf("must be %s or %s, got %q", ToolErrorsToModel, ToolErrorsFailRun, v)
	}
	return nil
}

func checkCancelCause(v string) error {
	if v != CancelCauseClientDisconnect {
		return fmt.Errorf("must be %s, got %q", CancelCauseClientDisconnect, v)
	}
	return nil
}
