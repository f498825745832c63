package openaiapi

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"unicode"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ShouldRetryHeader tells OpenAI's SDKs whether to retry a failed request. A retry of a
// completion without an idempotency key would start the agent again, so every error of
// one says false; with a key, a retry attaches to the same run, and the SDK decides
// (docs/openai.md).
const ShouldRetryHeader = "X-Should-Retry"

// httpError maps a gRPC code to the HTTP status and OpenAI error type of its answer.
func httpError(c codes.Code) (int, string) {
	switch c {
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest, "invalid_request_error"
	case codes.Unauthenticated:
		return http.StatusUnauthorized, "authentication_error"
	case codes.PermissionDenied:
		return http.StatusForbidden, "permission_error"
	case codes.NotFound:
		return http.StatusNotFound, "not_found_error"
	case codes.AlreadyExists, codes.Aborted:
		return http.StatusConflict, "conflict_error"
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests, "rate_limit_error"
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout, "timeout_error"
	case codes.Unavailable:
		return http.StatusServiceUnavailable, "service_unavailable_error"
	case codes.Canceled:
		return 499, "cancelled_error" // the client went away; no one reads this
	default:
		return http.StatusInternalServerError, "server_error"
	}
}

// writeStatus answers err, a gRPC status, in OpenAI's error shape. An internal error's
// message is logged, not sent.
func (h *Handler) writeStatus(w http.ResponseWriter, err error) {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		err = status.FromContextError(err).Err()
	}
	if a, ok := w.(*answer); !ok || !a.keyed {
		w.Header().Set(ShouldRetryHeader, "false")
	}
	var br *badRequest
	if errors.As(err, &br) {
		writeError(w, http.StatusBadRequest, "invalid_request_error", br.param, "invalid_request", br.msg)
		return
	}
	st := status.Convert(err)
	code, typ := httpError(st.Code())
	msg := st.Message()
	if code == http.StatusInternalServerError {
		h.cfg.Log.Error("openai front door: internal error", "code", st.Code().String(), "error", st.Message())
		msg = "internal error"
	}
	if code == http.StatusTooManyRequests {
		if d, ok := retryAfter(st); ok {
			w.Header().Set("Retry-After", strconv.FormatInt(int64(math.Ceil(d)), 10))
		}
	}
	writeError(w, code, typ, "", codeName(st.Code()), msg)
}

// retryAfter is the RetryInfo delay of st in seconds.
func retryAfter(st *status.Status) (float64, bool) {
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return math.Max(1, ri.GetRetryDelay().AsDuration().Seconds()), true
		}
	}
	return 0, false
}

// codeName is a gRPC code as an OpenAI error code: "resource_exhausted".
func codeName(c codes.Code) string {
	var b strings.Builder
	for i, r := range c.String() { // "ResourceExhausted"
		if unicode.IsUpper(r) {
			if i > 0 {
				b.WriteByte('_')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}
