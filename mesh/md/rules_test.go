package md_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/md"
)

// Each malformed value is refused with INVALID_ARGUMENT naming its header; each edge of
// the rules is accepted.
func TestCheck(t *testing.T) {
	long := func(n int, c string) string { return strings.Repeat(c, n) }
	for _, tc := range []struct {
		name string
		kv   []string
		bad  string // the header named in the refusal; "" accepts
	}{
		{"none", nil, ""},
		{"empty values are absent", []string{md.Deadline, "", md.RetryID, " ", md.Attempt, ""}, ""},
		{"deadline min", []string{md.Deadline, "1000000000000"}, ""},
		{"deadline max", []string{md.Deadline, "9999999999999"}, ""},
		{"deadline trimmed", []string{md.Deadline, " 1764460800000 "}, ""},
		{"deadline word", []string{md.Deadline, "yesterday"}, md.Deadline},
		{"deadline seconds", []string{md.Deadline, "1764460800"}, md.Deadline},
		{"deadline micros", []string{md.Deadline, "1764460800000000"}, md.Deadline},
		{"deadline negative", []string{md.Deadline, "-1764460800000"}, md.Deadline},
		{"deadline signed", []string{md.Deadline, "+1764460800000"}, md.Deadline},
		{"deadline float", []string{md.Deadline, "1.7e12"}, md.Deadline},
		{"deadline overflow", []string{md.Deadline, "99999999999999999999999"}, md.Deadline},
		{"deadline twice", []string{md.Deadline, "1764460800000", md.Deadline, "1764460800001"}, md.Deadline},
		{"retry-id uuid", []string{md.RetryID, "01a22c27-439a-718e-b1bc-9693df540c95"}, ""},
		{"retry-id token", []string{md.RetryID, "rid-e2e.1:x_y"}, ""},
		{"retry-id max", []string{md.RetryID, long(md.MaxIDLen, "a")}, ""},
		{"retry-id long", []string{md.RetryID, long(md.MaxIDLen+1, "a")}, md.RetryID},
		{"retry-id path", []string{md.RetryID, "../../etc"}, md.RetryID},
		{"retry-id space", []string{md.RetryID, "a b"}, md.RetryID},
		{"retry-id unicode", []string{md.RetryID, "ré"}, md.RetryID},
		{"attempt 1", []string{md.RetryID, "r", md.Attempt, "1"}, ""},
		{"attempt max", []string{md.RetryID, "r", md.Attempt, "100"}, ""},
		{"attempt trimmed", []string{md.RetryID, "r", md.Attempt, " 2 "}, ""},
		{"attempt 0", []string{md.RetryID, "r", md.Attempt, "0"}, md.Attempt},
		{"attempt negative", []string{md.RetryID, "r", md.Attempt, "-1"}, md.Attempt},
		{"attempt signed", []string{md.RetryID, "r", md.Attempt, "+2"}, md.Attempt},
		{"attempt over", []string{md.RetryID, "r", md.Attempt, "101"}, md.Attempt},
		{"attempt huge", []string{md.RetryID, "r", md.Attempt, "99999999999999999999"}, md.Attempt},
		{"attempt without retry-id (admission's signal)", []string{md.Attempt, "2"}, ""},
		{"hedge backup", []string{md.RetryID, "r", md.Hedge, "1"}, ""},
		{"hedge trimmed", []string{md.Hedge, " 1 "}, ""},
		{"hedge true", []string{md.Hedge, "true"}, md.Hedge},
		{"hedge 0", []string{md.Hedge, "0"}, md.Hedge},
		{"run-id uuid", []string{md.RunID, "019ad3c1-7d2e-7c4a-9f00-5b1de0c0ffee"}, ""},
		{"run-id slash", []string{md.RunID, "a/b"}, md.RunID},
		{"node-id path", []string{md.NodeID, "root/s0.t1/sub/m0"}, ""},
		{"node-id max", []string{md.NodeID, long(md.MaxNodeIDLen/2-1, "a/") + "ab"}, ""},
		{"node-id long", []string{md.NodeID, long(md.MaxNodeIDLen+1, "a")}, md.NodeID},
		{"node-id dotdot", []string{md.NodeID, "root/../.."}, md.NodeID},
		{"node-id dot", []string{md.NodeID, "root/./x"}, md.NodeID},
		{"node-id empty element", []string{md.NodeID, "root//x"}, md.NodeID},
		{"node-id leading slash", []string{md.NodeID, "/root"}, md.NodeID},
		{"tenant", []string{md.Tenant, "acme.corp_2-x"}, ""},
		{"tenant max", []string{md.Tenant, long(md.MaxTenantLen, "t")}, ""},
		{"tenant long", []string{md.Tenant, long(md.MaxTenantLen+1, "t")}, md.Tenant},
		{"tenant spaces", []string{md.Tenant, "tenant with spaces"}, md.Tenant},
		{"tenant nul", []string{md.Tenant, "a\x00b"}, md.Tenant},
		{"tenant colon", []string{md.Tenant, "a:b"}, md.Tenant},
		{"pool", []string{md.Pool, "overflow"}, ""},
		{"pool max", []string{md.Pool, long(md.MaxPoolLen, "p")}, ""},
		{"pool long", []string{md.Pool, long(md.MaxPoolLen+1, "p")}, md.Pool},
		{"pool spaces", []string{md.Pool, "over flow"}, md.Pool},
		{"pool slash", []string{md.Pool, "a/b"}, md.Pool},
		{"key", []string{md.IdempotencyKey, "nightly-2026-11-30/job#7"}, ""},
		{"key max", []string{md.IdempotencyKey, long(md.MaxIdempotencyKeyLen, "k")}, ""},
		{"key long", []string{md.IdempotencyKey, long(md.MaxIdempotencyKeyLen+1, "k")}, md.IdempotencyKey},
		{"key space", []string{md.IdempotencyKey, "a b"}, md.IdempotencyKey},
		{"key control", []string{md.IdempotencyKey, "a\tb"}, md.IdempotencyKey},
		{"tool errors to model", []string{md.ToolErrors, md.ToolErrorsToModel}, ""},
		{"tool errors fail run", []string{md.ToolErrors, md.ToolErrorsFailRun}, ""},
		{"tool errors other", []string{md.ToolErrors, "FAIL_RUN"}, md.ToolErrors},
		{"cancel cause", []string{md.CancelCause, md.CancelCauseClientDisconnect}, ""},
		{"cancel cause other", []string{md.CancelCause, "deadline"}, md.CancelCause},
		{"key unicode", []string{md.IdempotencyKey, "ключ"}, md.IdempotencyKey},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(tc.kv...))
			err := md.Check(ctx)
			if tc.bad == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				return
			}
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("err = %v, want INVALID_ARGUMENT", err)
			}
			if h, ok := md.InvalidHeader(err); !ok || h != tc.bad {
				t.Errorf("refusal names %q (%v), want %q: %v", h, ok, tc.bad, err)
			}
			if msg := status.Convert(err).Message(); !strings.Contains(msg, "must be") && !strings.Contains(msg, "once") {
				t.Errorf("message %q does not state the rule", msg)
			}
		})
	}
}

// The first malformed header in the contract's order is the one named.
func TestCheckNamesFirstInOrder(t *testing.T) {
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(md.RetryID, "../x", md.Deadline, "soon"))
	if h, _ := md.InvalidHeader(md.Check(ctx)); h != md.Deadline {
		t.Errorf("named %q, want %s", h, md.Deadline)
	}
}

// A refused value is echoed clipped, not whole.
func TestCheckClipsValue(t *testing.T) {
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(md.Tenant, strings.Repeat("x y", 10000)))
	if msg := status.Convert(md.Check(ctx)).Message(); len(msg) > 300 {
		t.Errorf("message is %d bytes long", len(msg))
	}
}

func TestValidTenant(t *testing.T) {
	if !md.ValidTenant(md.DefaultTenant) {
		t.Error("the default tenant is not valid")
	}
}
