package admission_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

func TestShedStatus(t *testing.T) {
	se := &admission.ShedError{Reason: admission.ReasonDeadlineSlack, RetryAfter: 750 * time.Millisecond,
		Pool: "paid", Tenant: "acme", Detail: "expected 2s + grace 1s > slack 1.5s"}
	for name, err := range map[string]error{"direct": se, "wrapped": fmt.Errorf("orchestrator: %w", se)} {
		t.Run(name, func(t *testing.T) {
			st, ok := status.FromError(err)
			if !ok || st.Code() != codes.ResourceExhausted {
				t.Fatalf("status %v (ok %v), want RESOURCE_EXHAUSTED", st, ok)
			}
			var ri *errdetails.RetryInfo
			var ei *errdetails.ErrorInfo
			for _, d := range st.Details() {
				switch d := d.(type) {
				case *errdetails.RetryInfo:
					ri = d
				case *errdetails.ErrorInfo:
					ei = d
				}
			}
			if ri == nil || ri.GetRetryDelay().AsDuration() != 750*time.Millisecond {
				t.Errorf("RetryInfo %v, want 750ms", ri)
			}
			if ei == nil || ei.GetReason() != "SHED_DEADLINE_SLACK" || ei.GetDomain() != "curfew.dev" ||
				ei.GetMetadata()["pool"] != "paid" || ei.GetMetadata()["tenant"] != "acme" {
				t.Errorf("ErrorInfo %v", ei)
			}
		})
	}
}

// A shed read back from the wire (a status error, not the Go type).
func TestAsShedFromWire(t *testing.T) {
	se := &admission.ShedError{Reason: admission.ReasonPoolClosed, RetryAfter: 40 * time.Second, Pool: "overflow",
		Tenant: "free", Condition: "orphan_tokens", Detail: "closed"}
	wire := status.ErrorProto(se.GRPCStatus().Proto())
	got, ok := admission.AsShed(wire)
	if !ok {
		t.Fatal("AsShed did not recognise the wire form")
	}
	if got.Reason != se.Reason || got.RetryAfter != se.RetryAfter || got.Pool != se.Pool || got.Tenant != se.Tenant || got.Condition != se.Condition {
		t.Errorf("round trip %+v, want %+v", got, se)
	}
	for _, err := range []error{nil, context.Canceled, status.Error(codes.ResourceExhausted, "other")} {
		if _, ok := admission.AsShed(err); ok {
			t.Errorf("AsShed(%v) recognised a shed", err)
		}
	}
	if code := status.Code(&admission.ShedError{Reason: admission.ReasonShutdown}); code != codes.Unavailable {
		t.Errorf("shutdown code %v", code)
	}
	for _, r := range admission.Reasons() {
		if r.ErrorInfoReason() == "" || r.ErrorInfoReason()[:5] != "SHED_" {
			t.Errorf("reason %s: ErrorInfo reason %q", r, r.ErrorInfoReason())
		}
	}
}

func TestParseCriticality(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want admission.Criticality
	}{{"", admission.Critical}, {"critical", admission.Critical}, {"SHEDDABLE", admission.Sheddable}, {" sheddable ", admission.Sheddable}} {
		if got, err := admission.ParseCriticality(tc.in); err != nil || got != tc.want {
			t.Errorf("ParseCriticality(%q) = %q, %v", tc.in, got, err)
		}
	}
	if _, err := admission.ParseCriticality("critical_plus"); err == nil {
		t.Error("unknown criticality accepted")
	}
}
