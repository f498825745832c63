package orchestrator

import (
	"context"
	"errors"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// A CancelRun of a run that another orchestrator owns (any replica on a shared store may
// receive it) is forwarded to the owner, whose address its lease names (OwnerName), so
// that the run's tree stops as fast as on the owner itself. When the owner cannot be
// reached, the cancel is also broadcast to the leaves and remembered: if the owner died,
// the orchestrator that takes the run over (this one included) ends it CANCELLED instead
// of resuming it, so that no cancel is lost with its owner. When the store cannot be read
// to find the owner, the cancel goes to every peer this process knows (peers.go).

// cancelMemory is how long a cancel of a run owned elsewhere is remembered for a takeover.
const cancelMemory = 10 * time.Minute

// OwnerName returns the lease owner name of an orchestrator incarnation: its id, and
// the address other orchestrators reach it at to forward a CancelRun or a WatchRun ("" for
// none).
func OwnerName(id, addr string) string {
	if addr == "" {
		return id
	}
	return id + "@" + addr
}

// ownerAddr returns the address in an owner name, or "".
func ownerAddr(owner string) string {
	if i := strings.LastIndexByte(owner, '@'); i >= 0 {
		return owner[i+1:]
	}
	return ""
}

// cancelElsewhere cancels a run this process does not hold: it forwards the call to the
// run's owner, else broadcasts the cancel and waits for the run to end, taking it over
// here if its owner's lease expires meanwhile. While the store is down it asks its peers
// (cancelAtPeers), and fails UNAVAILABLE when none holds the run.
func (s *Server) cancelElsewhere(ctx context.Context, req *orchestratorv1.CancelRunRequest) (*orchestratorv1.Run, error) {
	id := req.GetRunId()
	tenant := md.IdentityFrom(ctx).Tenant
	forwarded := forwardedCall(ctx)
	run, err := s.cfg.Store.GetRun(ctx, tenant, id)
	if err != nil {
		if errors.Is(err, store.ErrUnavailable) && !forwarded {
			if r, ok := s.cancelAtPeers(ctx, req); ok {
				return r, nil
			}
		}
		return nil, runStoreErr(ctx, s.cfg.Log, "get run", id, err)
	}
	if run.Status.Terminal() {
		return s.fromStore(ctx, run), nil
	}
	tried := ""
	if !forwarded {
		if r, ok := s.forwardCancel(ctx, run, req); ok {
			return r, nil
		}
		tried = run.Owner
	}
	s.cfg.Log.InfoContext(ctx, "run owned by another orchestrator cancelled by operator; its owner was not reached, so the cancel is broadcast and kept for a takeover",
		"run_id", id, "owner", run.Owner, "reason", req.GetReason())
	s.rememberCancel(id)
	s.broadcastCancel(ctx, id, cancel.ErrOperator, 0, s.cfg.Reports)
	for {
		t := time.NewTimer(watchPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, status.FromContextError(ctx.Err()).Err()
		case <-t.C:
		}
		if rn, err := s.visible(ctx, id); err == nil { // taken over here meanwhile
			return s.cancelHere(ctx, rn, req)
		}
		run, err = s.cfg.Store.GetRun(ctx, tenant, id)
		if err != nil {
			return nil, runStoreErr(ctx, s.cfg.Log, "get run", id, err)
		}
		if run.Status.Terminal() {
			return s.fromStore(ctx, run), nil
		}
		if !forwarded && run.Owner != tried && run.Owner != "" { // moved to another owner
			if r, ok := s.forwardCancel(ctx, run, req); ok {
				return r, nil
			}
			tried = run.Owner
		}
	}
}

// forwardedCall reports whether the incoming call was forwarded by another orchestrator
// (a CancelRun, or a WatchRun relayed from the owner: watchfwd.go): it is not forwarded
// again.
func forwardedCall(ctx context.Context) bool {
	return len(metadata.ValueFromIncomingContext(ctx, md.CancelForwarded)) > 0
}

// forwardedContext is the context of a call forwarded to another orchestrator (a
// CancelRun, a relayed WatchRun): marked forwarded (md.CancelForwarded), and carrying the
// caller's API key when it sent one, and a CancelRun's cause header. The owner authenticates
// the tenant itself: by the key, or, from this orchestrator as its mesh peer, by the
// curfew-tenant the client chain sends (the tenant authenticated here). Over plaintext
// (--insecure) there are no mesh peers, so the key is what lets the call through.
func forwardedContext(ctx context.Context) context.Context {
	kv := []string{md.CancelForwarded, "1"}
	if auth := metadata.ValueFromIncomingContext(ctx, apikey.Header); len(auth) == 1 {
		kv = append(kv, apikey.Header, auth[0])
	}
	if clientLeft(ctx) {
		kv = append(kv, md.CancelCause, md.CancelCauseClientDisconnect)
	}
	return metadata.AppendToOutgoingContext(ctx, kv...)
}

// forwardCancel sends the CancelRun to the run's owner; ok is false when the owner has
// no address, is this process, or could not be reached.
func (s *Server) forwardCancel(ctx context.Context, run store.Run, req *orchestratorv1.CancelRunRequest) (*orchestratorv1.Run, bool) {
	addr := ownerAddr(run.Owner)
	if addr == "" || s.cfg.Peers == nil || run.Owner == s.cfg.Owner {
		return nil, false
	}
	peer, err := s.cfg.Peers(addr)
	if err == nil {
		var resp *orchestratorv1.CancelRunResponse
		resp, err = peer.CancelRun(forwardedContext(ctx), req)
		if err == nil {
			s.cfg.Log.InfoContext(ctx, "run owned by another orchestrator cancelled by operator, through its owner",
				"run_id", run.RunID, "owner", run.Owner, "reason", req.GetReason())
			return resp.GetRun(), true
		}
		if ctx.Err() == nil && status.Code(err) != codes.Unavailable && status.Code(err) != codes.NotFound {
			s.cfg.Log.WarnContext(ctx, "forwarding a cancel to the run's owner failed", "run_id", run.RunID, "owner", run.Owner, "error", err.Error())
		}
	}
	return nil, false
}

// rememberCancel keeps a cancel of a run owned elsewhere for a takeover of it here.
func (s *Server) rememberCancel(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	for k, at := range s.cancels {
		if now.Sub(at) > cancelMemory {
			delete(s.cancels, k)
		}
	}
	if s.cancels == nil {
		s.cancels = map[string]time.Time{}
	}
	s.cancels[id] = now
}

// cancelRequested reports, and forgets, whether a cancel of the run was remembered.
func (s *Server) cancelRequested(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.cancels[id]
	delete(s.cancels, id)
	return ok
}

// endCancelled ends a run this process has just claimed, and that an operator cancelled
// while its owner could not be reached, as CANCELLED (cause operator) without resuming it.
func (s *Server) endCancelled(ctx context.Context, r store.Run) {
	rn := newRun(r)
	rec := rn.rec
	rec.Status, rec.Cause = orchestratorv1.RunStatus_RUN_STATUS_CANCELLED, meshv1.CancelCause_CANCEL_CAUSE_OPERATOR
	rec.ErrorCode, rec.ErrorMessage = "CANCELLED", "cancelled by an operator while its owner was unreachable; not resumed"
	now := timestamppb.Now()
	rec.EndedAt, rec.CancelledAt = now, now
	if s.commit(ctx, rn) {
		s.leaseMetrics.takeover(takeoverCancelled)
		s.cfg.Log.InfoContext(ctx, "took over a run cancelled while its owner was unreachable; ended it without resuming", "run_id", r.RunID, "epoch", r.Epoch)
	}
}
