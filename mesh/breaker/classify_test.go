package breaker_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

func withDetails(t *testing.T, c codes.Code, details ...*errdetails.ErrorInfo) error {
	t.Helper()
	st := status.New(c, "x")
	for _, d := range details {
		var err error
		if st, err = st.WithDetails(d); err != nil {
			t.Fatal(err)
		}
	}
	return st.Err()
}

func TestClassify(t *testing.T) {
	const (
		S = breaker.OutcomeSuccess
		F = breaker.OutcomeFailure
		I = breaker.OutcomeIgnored
	)
	live := t.Context()
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	expired, cancel2 := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel2()
	short, cancel3 := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel3()
	long, cancel4 := context.WithTimeout(t.Context(), time.Minute)
	defer cancel4()
	pushback, err := status.New(codes.ResourceExhausted, "shed").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		ctx  context.Context
		err  error
		want breaker.Outcome
	}{
		{"nil", live, nil, S},
		{"nil, caller gone", cancelled, nil, S},
		{"OK status", live, status.Error(codes.OK, ""), S},
		{"CANCELED", live, status.Error(codes.Canceled, "x"), I},
		{"UNAVAILABLE, caller cancelled", cancelled, status.Error(codes.Unavailable, "x"), I},
		{"INTERNAL, caller's deadline passed", expired, status.Error(codes.Internal, "x"), I},
		{"DEADLINE_EXCEEDED, caller's deadline passed", expired, status.Error(codes.DeadlineExceeded, "x"), I},
		{"DEADLINE_EXCEEDED, caller's deadline within the slack", short, status.Error(codes.DeadlineExceeded, "x"), I},
		{"DEADLINE_EXCEEDED, no time left to start", long, status.Error(codes.DeadlineExceeded, "no time left to start tool x: 1ms left, needs 10ms"), I},
		{"DEADLINE_EXCEEDED, no time left to retry", long, status.Error(codes.DeadlineExceeded, "no time left to retry /m after attempt 1"), I},
		{"DEADLINE_EXCEEDED, caller had a minute left", long, status.Error(codes.DeadlineExceeded, "x"), F},
		{"DEADLINE_EXCEEDED, caller without deadline", live, status.Error(codes.DeadlineExceeded, "x"), F},
		{"INVALID_ARGUMENT", live, status.Error(codes.InvalidArgument, "x"), S},
		{"NOT_FOUND", live, status.Error(codes.NotFound, "x"), S},
		{"ALREADY_EXISTS", live, status.Error(codes.AlreadyExists, "x"), S},
		{"PERMISSION_DENIED", live, status.Error(codes.PermissionDenied, "x"), S},
		{"UNAUTHENTICATED", live, status.Error(codes.Unauthenticated, "x"), S},
		{"FAILED_PRECONDITION", live, status.Error(codes.FailedPrecondition, "x"), S},
		{"OUT_OF_RANGE", live, status.Error(codes.OutOfRange, "x"), S},
		{"UNIMPLEMENTED", live, status.Error(codes.Unimplemented, "x"), S},
		{"ABORTED", live, status.Error(codes.Aborted, "superseded"), S},
		{"RESOURCE_EXHAUSTED with RetryInfo", live, pushback.Err(), I},
		{"RESOURCE_EXHAUSTED without RetryInfo", live, status.Error(codes.ResourceExhausted, "x"), F},
		{"RESOURCE_EXHAUSTED, a tenant's budget refusal", live, (&budget.Refusal{Tenant: "acme", Budget: 1}).GRPCStatus().Err(), I},
		{"UNAVAILABLE", live, status.Error(codes.Unavailable, "x"), F},
		{"INTERNAL", live, status.Error(codes.Internal, "x"), F},
		{"UNKNOWN", live, status.Error(codes.Unknown, "x"), F},
		{"DATA_LOSS", live, status.Error(codes.DataLoss, "x"), F},
		{"a code from the future", live, status.Error(codes.Code(42), "x"), F},
		{"BREAKER_OPEN from below", live, withDetails(t, codes.Unavailable, &errdetails.ErrorInfo{Reason: "BREAKER_OPEN", Domain: "curfew.dev"}), I},
		{"retried to exhaustion below", live, retry.MarkExhausted(status.Error(codes.Unavailable, "x"), 3), I},
		{"relayed", live, breaker.Relay(status.Error(codes.Unavailable, "tool backend down")), I},
		{"relayed INTERNAL", live, breaker.Relay(status.Error(codes.Internal, "x")), I},
		{"a foreign domain's BREAKER_OPEN", live, withDetails(t, codes.Unavailable, &errdetails.ErrorInfo{Reason: "BREAKER_OPEN", Domain: "example.com"}), F},
		{"context.Canceled", live, context.Canceled, I},
		{"wrapped context.Canceled", live, fmt.Errorf("post: %w", context.Canceled), I},
		{"context.DeadlineExceeded, caller had time", long, context.DeadlineExceeded, F},
		{"context.DeadlineExceeded, caller's deadline near", short, context.DeadlineExceeded, I},
		{"plain error", live, errors.New("connection reset"), F},
		{"nil context", nil, status.Error(codes.Unavailable, "x"), F},
	}
	for _, tc := range cases {
		if got := breaker.Classify(tc.ctx, tc.err); got != tc.want {
			t.Errorf("%s: Classify = %s, want %s", tc.name, got, tc.want)
		}
		if got := breaker.Failure(tc.ctx, tc.err); got != (tc.want == F) {
			t.Errorf("%s: Failure = %v", tc.name, got)
		}
	}
}

func TestRelayKeepsTheStatus(t *testing.T) {
	orig, err := status.New(codes.Unavailable, "backend down").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	r := breaker.Relay(orig.Err())
	st := status.Convert(r)
	if st.Code() != codes.Unavailable || st.Message() != "backend down" || len(st.Details()) != 2 {
		t.Errorf("relayed status %v with %d details, want the original plus a marker", st, len(st.Details()))
	}
	if again := breaker.Relay(r); len(status.Convert(again).Details()) != 2 {
		t.Error("Relay marked an error twice")
	}
	plain := errors.New("x")
	if got := breaker.Relay(plain); got != plain || breaker.Relay(nil) != nil { //nolint:errorlint // the very same error value is the point
		t.Error("Relay changed a non-status error or nil")
	}
}
