package orchestrator

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Both list calls read their page the same way: a size clamped to (0, most], 0 meaning
// the default, and a token that must be one of the UUIDs this service issues.
func TestPageOf(t *testing.T) {
	const id = "019ad3c1-7d2e-7c4a-9f00-5b1de0c0ffee"
	for _, c := range []struct {
		size  int32
		token string
		want  int
		code  codes.Code
	}{
		{0, "", 10, codes.OK},
		{3, id, 3, codes.OK},
		{50, "", 50, codes.OK},
		{51, "", 50, codes.OK},
		{-1, "", 0, codes.InvalidArgument},
		{3, "' OR 1=1 --", 0, codes.InvalidArgument},
	} {
		size, after, err := pageOf(&orchestratorv1.ListRunsRequest{PageSize: c.size, PageToken: c.token}, 10, 50)
		if status.Code(err) != c.code || size != c.want || (err == nil && after != c.token) {
			t.Errorf("pageOf(%d, %q) = %d, %q, %v; want %d, %v", c.size, c.token, size, after, err, c.want, c.code)
		}
	}
}
