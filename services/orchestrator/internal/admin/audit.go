package admin

import (
	"context"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// audit records that the caller of ctx did action on target, with the request (which
// never holds a secret) and its reason. A change whose audit entry cannot be written
// is still made: the error is logged and the call answers UNAVAILABLE, so the operator
// retries (the methods are idempotent) and the entry lands on the retry.
func (s *Server) audit(ctx context.Context, action, target, reason string, req proto.Message) error {
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(req)
	if err != nil {
		b = nil
	}
	actor := apikey.Caller(ctx)
	if actor == "" {
		actor = "unknown"
	}
	// The entry is written even when the caller's context has ended: the change it
	// records has been made.
	_, err = s.cfg.Store.AddAudit(context.WithoutCancel(ctx), store.AuditEntry{
		Actor: actor, Action: action, Target: target, Reason: reason, Request: string(b),
	})
	if err != nil {
		s.cfg.Log.ErrorContext(ctx, "audit entry not written", "action", action, "target", target, "actor", actor, "error", err.Error())
		return status.Errorf(codes.Unavailable, "%s done, but its audit entry could not be written: repeat the command", action)
	}
	return nil
}

// ListAudit implements adminv1.AdminServiceServer.
func (s *Server) ListAudit(ctx context.Context, req *adminv1.ListAuditRequest) (*adminv1.ListAuditResponse, error) {
	q := store.AuditQuery{After: req.GetPageToken(), Limit: int(req.GetPageSize())}
	if req.GetPageSize() < 0 || req.GetPageSize() > 1000 {
		return nil, invalid("page_size must be between 0 and 1000, not %d", req.GetPageSize())
	}
	if req.Since != nil {
		q.Since = req.GetSince().AsTime()
	}
	es, next, err := s.cfg.Store.ListAudit(ctx, q)
	if err != nil {
		return nil, storeErr(err)
	}
	out := &adminv1.ListAuditResponse{NextPageToken: next}
	for _, e := range es {
		out.Entries = append(out.Entries, &adminv1.AuditEntry{
			Id: e.ID, At: timestamppb.New(e.At), Actor: e.Actor, Action: e.Action,
			Target: e.Target, Reason: e.Reason, RequestJson: e.Request,
		})
	}
	return out, nil
}

// storeErr maps a store error to the status an operator reads: the store's code, with
// its text for the caller's mistakes and without it for infrastructure failures.
func storeErr(err error) error {
	switch c := store.Code(err); c {
	case codes.OK:
		return nil
	case codes.Internal, codes.Unavailable:
		return status.Error(codes.Unavailable, "the store did not answer: retry")
	default:
		return status.Error(c, strings.TrimPrefix(err.Error(), "store: "))
	}
}
