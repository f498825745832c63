package provider

import (
	"errors"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/durationpb"
)

// errorStatus builds a provider error: code and message, an ErrorInfo with reason and
// metadata "provider" and, when httpCode is not 0, "http_status", and a RetryInfo when
// retry is set.
func errorStatus(c codes.Code, reason, provider string, httpCode int, retry *time.Duration, msg string) error {
	st := status.New(c, msg)
	info := &errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain, Metadata: map[string]string{"provider": provider}}
	if httpCode != 0 {
		info.Metadata["http_status"] = strconv.Itoa(httpCode)
	}
	details := []protoadapt.MessageV1{info}
	if retry != nil {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(*retry)})
	}
	withDetails, err := st.WithDetails(details...)
	if err != nil {
		return st.Err()
	}
	return withDetails.Err()
}

// ErrorReason returns the ErrorInfo reason of a provider error (one of the Reason*
// constants) and its HTTP status (0 when no response arrived), or "" and 0 for an error
// without provider details (the caller's cancel or deadline, a request refused before it
// was sent).
func ErrorReason(err error) (reason string, httpStatus int) {
	var se interface{ GRPCStatus() *status.Status }
	if !errors.As(err, &se) {
		return "", 0
	}
	for _, d := range se.GRPCStatus().Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.GetDomain() == ErrorDomain {
			code, _ := strconv.Atoi(info.GetMetadata()["http_status"])
			return info.GetReason(), code
		}
	}
	return "", 0
}

// retryAfter reads how long a 429 asks to wait: "retry-after-ms" (milliseconds, sent by
// OpenAI beside Retry-After) or "Retry-After" (seconds, or an HTTP date taken relative to
// now). nil when neither is present and valid; never negative.
func retryAfter(h http.Header, now time.Time) *time.Duration {
	if h == nil {
		return nil
	}
	if v := strings.TrimSpace(h.Get("Retry-After-Ms")); v != "" {
		if ms, err := strconv.ParseFloat(v, 64); err == nil && ms >= 0 && !math.IsInf(ms, 0) && ms < float64(math.MaxInt64/int64(time.Millisecond)) {
			d := time.Duration(ms * float64(time.Millisecond))
			return &d
		}
	}
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return nil
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs < 0 || secs > math.MaxInt64/int64(time.Second) {
			return nil
		}
		d := time.Duration(secs) * time.Second
		return &d
	}
	if at, err := http.ParseTime(v); err == nil {
		d := max(at.Sub(now), 0)
		return &d
	}
	return nil
}
