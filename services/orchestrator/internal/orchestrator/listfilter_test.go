package orchestrator

import (
	"context"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// ListRuns' filters: the model and the creation window [created_after, created_before),
// paged with them; a bad window is INVALID_ARGUMENT naming the field.
func TestListRunsFilters(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, nil)
	ctx := context.Background()
	var ids []string // oldest first
	for range 3 {
		rs, started := e.start(ctx, t, &orchestratorv1.RunRequest{Task: tinyPlan})
		if _, err := rs.rest(); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, started.GetRunId())
		time.Sleep(5 * time.Millisecond) // each run created in a millisecond of its own
	}
	list := func(req *orchestratorv1.ListRunsRequest) []string {
		t.Helper()
		var got []string
		for page := 0; ; page++ {
			resp, err := e.orch.ListRuns(ctx, req)
			if err != nil || page > 3 {
				t.Fatalf("ListRuns(%v) page %d: %v", req, page, err)
			}
			for _, r := range resp.GetRuns() {
				got = append(got, r.GetRunId())
			}
			if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" {
				return got
			}
		}
	}
	all, err := e.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{})
	if err != nil || len(all.GetRuns()) != 3 {
		t.Fatalf("ListRuns = %v, %v; want the 3 runs", all.GetRuns(), err)
	}
	created := map[string]*timestamppb.Timestamp{}
	for _, r := range all.GetRuns() {
		created[r.GetRunId()] = r.GetCreatedAt()
	}
	c := func(i int) *timestamppb.Timestamp { return created[ids[i]] }
	if !c(0).AsTime().Before(c(1).AsTime()) || !c(1).AsTime().Before(c(2).AsTime()) {
		t.Fatalf("creation times %v %v %v are not increasing", c(0).AsTime(), c(1).AsTime(), c(2).AsTime())
	}
	model := all.GetRuns()[0].GetModel()
	newest := func(is ...int) []string {
		var out []string
		for _, i := range slices.Backward(is) {
			out = append(out, ids[i])
		}
		return out
	}
	for _, tc := range []struct {
		name string
		req  *orchestratorv1.ListRunsRequest
		want []string
	}{
		{"the runs' model", &orchestratorv1.ListRunsRequest{Model: model}, newest(0, 1, 2)},
		{"another model", &orchestratorv1.ListRunsRequest{Model: "no-such-model"}, nil},
		{"created after run 1 (inclusive)", &orchestratorv1.ListRunsRequest{CreatedAfter: c(1)}, newest(1, 2)},
		{"created before run 1 (exclusive)", &orchestratorv1.ListRunsRequest{CreatedBefore: c(1)}, newest(0)},
		{"run 1's window", &orchestratorv1.ListRunsRequest{CreatedAfter: c(1), CreatedBefore: c(2)}, newest(1)},
		{"equal bounds", &orchestratorv1.ListRunsRequest{CreatedAfter: c(1), CreatedBefore: c(1)}, nil},
		{"pages of one", &orchestratorv1.ListRunsRequest{PageSize: 1, Model: model, CreatedAfter: c(0)}, newest(0, 1, 2)},
	} {
		if got := list(tc.req); !slices.Equal(got, tc.want) {
			t.Errorf("%s: listed %v, want %v", tc.name, got, tc.want)
		}
	}
	_, err = e.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{CreatedAfter: c(2), CreatedBefore: c(1)})
	meshtest.WantCode(t, err, codes.InvalidArgument, "created_after")
	_, err = e.orch.ListRuns(ctx, &orchestratorv1.ListRunsRequest{CreatedBefore: &timestamppb.Timestamp{Seconds: 1 << 40}})
	meshtest.WantCode(t, err, codes.InvalidArgument, "created_before")
}
