package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Paging limits of ListDeadLetters.
const (
	DefaultDeadLetterPageSize = 100
	MaxDeadLetterPageSize     = 1000
)

// ReplayKeyPrefix prefixes the idempotency key of a dead letter's replay run: the key is
// ReplayKeyPrefix + the dead letter's id, so every replay of one dead letter names the
// same run.
const ReplayKeyPrefix = "dlq-replay/"

// Replayer starts a dead letter's payload as a new detached run, idempotently on key.
type Replayer func(ctx context.Context, key string, payload []byte, timeout time.Duration) (runID string, created bool, err error)

// DeadLetterServer implements DeadLetterService on a store. Every call is scoped to the
// caller's tenant (md.IdentityFrom, set by the server chain; md.DefaultTenant when the
// context carries none): the store's all-tenants view (tenant "") is never reachable
// through it.
type DeadLetterServer struct {
	orchestratorv1.UnimplementedDeadLetterServiceServer
	st     store.DeadLetters
	replay Replayer
}

// NewDeadLetterServer returns a server on st that starts replays with replay.
func NewDeadLetterServer(st store.DeadLetters, replay Replayer) *DeadLetterServer {
	return &DeadLetterServer{st: st, replay: replay}
}

// dlTenant is the caller's tenant, never "".
func dlTenant(ctx context.Context) string {
	if t := md.IdentityFrom(ctx).Tenant; t != "" {
		return t
	}
	return md.DefaultTenant
}

// ListDeadLetters implements DeadLetterService.ListDeadLetters: newest first; the page
// token is the store's cursor, the id (a UUIDv7) of the previous page's last dead letter.
func (s *DeadLetterServer) ListDeadLetters(ctx context.Context, req *orchestratorv1.ListDeadLettersRequest) (*orchestratorv1.ListDeadLettersResponse, error) {
	size, after, err := pageOf(req, DefaultDeadLetterPageSize, MaxDeadLetterPageSize)
	if err != nil {
		return nil, err
	}
	dls, next, err := s.st.ListDeadLetters(ctx, store.DeadLetterQuery{
		Tenant: dlTenant(ctx), RunID: req.GetRunId(), IncludeReplayed: req.GetIncludeReplayed(), After: after, Limit: size,
	})
	if err != nil {
		return nil, storeStatus(err, "list dead letters")
	}
	resp := &orchestratorv1.ListDeadLettersResponse{NextPageToken: next, DeadLetters: make([]*orchestratorv1.DeadLetter, 0, len(dls))}
	for _, d := range dls {
		resp.DeadLetters = append(resp.DeadLetters, deadLetterPB(d))
	}
	return resp, nil
}

// GetDeadLetter implements DeadLetterService.GetDeadLetter.
func (s *DeadLetterServer) GetDeadLetter(ctx context.Context, req *orchestratorv1.GetDeadLetterRequest) (*orchestratorv1.GetDeadLetterResponse, error) {
	if req.GetId() == "" {
		return nil, status.Error(codes.InvalidArgument, "id is required")
	}
	d, err := s.st.GetDeadLetter(ctx, dlTenant(ctx), req.GetId())
	if err != nil {
		return nil, storeStatus(err, "dead letter "+req.GetId())
	}
	return &orchestratorv1.GetDeadLetterResponse{DeadLetter: deadLetterPB(d)}, nil
}

// ReplayDeadLetter implements DeadLetterService.ReplayDeadLetter. It marks the dead
// letter replayed first, then starts its payload under the key ReplayKeyPrefix+id. A dead
// letter already marked is started again under the same key, which the Replayer
// deduplicates: replaying twice starts one run, and a replay whose start failed after the
// mark can be retried.
func (s *DeadLetterServer) ReplayDeadLetter(ctx context.Context, req *orchestratorv1.ReplayDeadLetterRequest) (*orchestratorv1.ReplayDeadLetterResponse, error) {
	id := req.GetId()
	if id == "" {
		return nil, status.Error(codes.InvalidArgument, "id is required")
	}
	var timeout time.Duration
	if req.GetTimeout() != nil {
		if err := req.GetTimeout().CheckValid(); err != nil {
			return nil, status.Error(codes.InvalidArgument, "timeout is not a valid duration")
		}
		if timeout = req.GetTimeout().AsDuration(); timeout < 0 {
			return nil, status.Error(codes.InvalidArgument, "timeout must not be negative")
		}
	}
	if s.replay == nil {
		return nil, status.Error(codes.Unimplemented, "replay is not configured on this orchestrator")
	}
	d, err := s.st.MarkReplayed(ctx, dlTenant(ctx), id)
	switch {
	case errors.Is(err, store.ErrAlreadyReplayed):
		// A previous replay marked it. The store returns the record with the error; read
		// it should a backend not.
		if d.ID == "" {
			if d, err = s.st.GetDeadLetter(ctx, dlTenant(ctx), id); err != nil {
				return nil, storeStatus(err, "dead letter "+id)
			}
		}
	case err != nil:
		return nil, storeStatus(err, "dead letter "+id)
	}
	runID, created, err := s.replay(ctx, ReplayKeyPrefix+d.ID, d.Payload, timeout)
	if err != nil {
		return nil, replayStatus(err)
	}
	return &orchestratorv1.ReplayDeadLetterResponse{DeadLetter: deadLetterPB(d), RunId: runID, Created: created}, nil
}

// PurgeDeadLetters implements DeadLetterService.PurgeDeadLetters. At least one selector
// is required, so that an empty request cannot delete everything.
func (s *DeadLetterServer) PurgeDeadLetters(ctx context.Context, req *orchestratorv1.PurgeDeadLettersRequest) (*orchestratorv1.PurgeDeadLettersResponse, error) {
	q := store.PurgeQuery{Tenant: dlTenant(ctx), ID: req.GetId(), OnlyReplayed: req.GetOnlyReplayed()}
	if b := req.GetBefore(); b != nil {
		if err := b.CheckValid(); err != nil {
			return nil, status.Error(codes.InvalidArgument, "before is not a valid timestamp")
		}
		q.Before = b.AsTime()
		if q.Before.IsZero() || q.Before.UnixMilli() <= 0 {
			return nil, status.Error(codes.InvalidArgument, "before must be after the Unix epoch")
		}
	}
	if q.ID == "" && q.Before.IsZero() && !q.OnlyReplayed {
		return nil, status.Error(codes.InvalidArgument, "purge needs at least one of id, before and only_replayed")
	}
	n, err := s.st.PurgeDeadLetters(ctx, q)
	if err != nil {
		return nil, storeStatus(err, "purge dead letters")
	}
	return &orchestratorv1.PurgeDeadLettersResponse{Purged: n}, nil
}

// storeStatus maps a store error to a gRPC status. what names the object for the
// conditions a caller can act on; an infrastructure failure is UNAVAILABLE with a generic
// message, so that no SQL text reaches the client.
func storeStatus(err error, what string) error {
	return storeError(err, what, "dead letter store unavailable")
}

// replayStatus keeps a Replayer's gRPC status and maps anything else.
func replayStatus(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return storeError(err, "replay run", "could not start the replay run")
}

// storeError maps a store error (classified by store.Code) to a gRPC status for the
// caller, never with the store's own text unless the store wrote it for callers
// (invalid arguments); what names the thing for "not found", unavailable is the message
// of an unclassified failure. The one mapping for runs and dead letters alike.
func storeError(err error, what, unavailable string) error {
	switch c := store.Code(err); c {
	case codes.NotFound:
		return status.Error(c, what+" not found")
	case codes.InvalidArgument:
		return status.Error(c, err.Error())
	case codes.Canceled:
		return status.Error(c, "the call was cancelled")
	case codes.DeadlineExceeded:
		return status.Error(c, "the call's deadline passed")
	case codes.Internal, codes.Unavailable:
		return status.Error(codes.Unavailable, unavailable)
	default:
		return status.Error(c, what+": "+c.String())
	}
}

// deadLetterPB converts a stored dead letter; zero timestamps are left unset.
func deadLetterPB(d store.DeadLetter) *orchestratorv1.DeadLetter {
	return &orchestratorv1.DeadLetter{
		Id:             d.ID,
		Tenant:         d.Tenant,
		RunId:          d.RunID,
		Step:           d.Step,
		ErrorType:      d.ErrorType,
		Attempts:       int32(d.Attempts), //nolint:gosec // attempts are small
		LastError:      d.LastError,
		Payload:        d.Payload,
		IdempotencyKey: d.IdempotencyKey,
		CreatedAt:      dlTimestamp(d.CreatedAt),
		ReplayedAt:     dlTimestamp(d.ReplayedAt),
		ReplayCount:    int32(d.ReplayCount), //nolint:gosec // replay counts are small
	}
}

func dlTimestamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

// DeadLetterRecorder records a run that failed for good; mesh/dlq.Recorder is one.
type DeadLetterRecorder interface {
	Record(ctx context.Context, d store.DeadLetter) (store.DeadLetter, bool, error)
}

// deadLetter records a run that failed for good. errType overrides the error class.
func (s *Server) deadLetter(ctx context.Context, r *orchestratorv1.Run, errType string) {
	if s.cfg.DeadLetters == nil {
		return
	}
	step, attempts := failingStep(r)
	if errType == "" {
		errType = strings.ToLower(r.GetErrorCode())
	}
	payload, _ := json.Marshal(ReplayPayload{Task: r.GetTask(), Model: r.GetModel(), Input: encodeInput(r.GetInput())})
	dctx, stop := context.WithTimeout(context.WithoutCancel(ctx), storeTimeout)
	defer stop()
	d, added, err := s.cfg.DeadLetters.Record(dctx, store.DeadLetter{Tenant: r.GetTenant(), RunID: r.GetRunId(), Step: step,
		ErrorType: errType, Attempts: attempts, LastError: r.GetErrorMessage(), Payload: payload, IdempotencyKey: r.GetIdempotencyKey()})
	if err != nil {
		s.cfg.Log.ErrorContext(ctx, "record dead letter", "run_id", r.GetRunId(), "error", err.Error(), "stored", d.ID != "")
		return
	}
	if added {
		s.cfg.Log.WarnContext(ctx, "run failed for good: dead letter recorded", "run_id", r.GetRunId(), "dead_letter", d.ID,
			"step", step, "error_type", errType, "attempts", attempts)
	}
}

// failingStep names the deepest failed node that carries the run's error, and its
// attempts; "root" and 1 when no node does.
func failingStep(r *orchestratorv1.Run) (string, int) {
	step, attempts, depth := RootNode, 1, -1
	for _, n := range r.GetNodes() {
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || n.GetErrorCode() != r.GetErrorCode() {
			continue
		}
		if d := strings.Count(n.GetId(), "/"); d > depth {
			step, depth = n.GetId(), d
			attempts = max(int(n.GetAttempt()), 1+len(n.GetEarlierAttempts()), 1)
		}
	}
	return step, attempts
}
