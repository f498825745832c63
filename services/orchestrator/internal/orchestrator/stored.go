package orchestrator

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Runs read from the store: those this process does not hold (another orchestrator's,
// or its own forgotten beyond MaxRuns), and every ListRuns page.

// stored reads the caller's tenant's run from the store. A live run's nodes are read
// from the executors.
func (s *Server) stored(ctx context.Context, id string) (*orchestratorv1.Run, error) {
	run, err := s.cfg.Store.GetRun(ctx, md.IdentityFrom(ctx).Tenant, id)
	if err != nil {
		return nil, runStoreErr(ctx, s.cfg.Log, "get run", id, err)
	}
	r := s.fromStore(ctx, run)
	if !run.Status.Terminal() {
		setNodes(r, s.collect(ctx, id, allReports, time.Time{}, 0))
	}
	return r, nil
}

// listStored reads one page of q from the store.
func (s *Server) listStored(ctx context.Context, q store.RunQuery) (*orchestratorv1.ListRunsResponse, error) {
	runs, next, err := s.cfg.Store.ListRuns(ctx, q)
	if err != nil {
		return nil, runStoreErr(ctx, s.cfg.Log, "list runs", "", err)
	}
	resp := &orchestratorv1.ListRunsResponse{NextPageToken: next}
	for _, run := range runs {
		r := s.fromStore(ctx, run)
		r.Nodes = nil
		resp.Runs = append(resp.Runs, r)
	}
	return resp, nil
}

// fromStore turns a stored run into the API's: its stored summary when it ended here or
// elsewhere, else what the row holds.
func (s *Server) fromStore(ctx context.Context, run store.Run) *orchestratorv1.Run {
	if len(run.Summary) > 0 {
		r := &orchestratorv1.Run{}
		if err := proto.Unmarshal(run.Summary, r); err == nil {
			r.Epoch = epochOf(run.Epoch, s.shared)
			r.StartedBy = run.StartedBy
			return r
		}
		s.cfg.Log.WarnContext(ctx, "stored run summary does not decode; serving the row", "run_id", run.RunID)
	}
	r := &orchestratorv1.Run{RunId: run.RunID, Tenant: run.Tenant, Status: apiStatusOf(run.Status),
		Deadline: timestamppb.New(run.Deadline), CreatedAt: timestamppb.New(run.CreatedAt), Answer: string(run.Answer),
		ErrorMessage: run.Error, Model: run.Model, Task: string(run.Task), IdempotencyKey: run.IdempotencyKey, Input: decodeInput(run.Input),
		Epoch: epochOf(run.Epoch, s.shared), StartedBy: run.StartedBy}
	if !run.EndedAt.IsZero() {
		r.EndedAt = timestamppb.New(run.EndedAt)
	}
	r.Cause = cancel.Parse(run.Cause)
	return r
}

// runStoreErr maps a store error of a run operation on run id ("": none) to the
// caller's status, with storeError's classification (store.Code): a run not found is
// NOT_FOUND as for a run this process does not hold; an unclassified failure is logged,
// and the caller gets UNAVAILABLE without the store's text.
func runStoreErr(ctx context.Context, log *slog.Logger, op, id string, err error) error {
	if store.Code(err) == codes.Internal {
		log.ErrorContext(ctx, "store call failed", "op", op, "error", err.Error())
	}
	what := "run"
	if id != "" {
		what = fmt.Sprintf("run %q", id)
	}
	return storeError(err, what, op+": the run store is unavailable")
}
