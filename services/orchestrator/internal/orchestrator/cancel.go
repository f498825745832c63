package orchestrator

import (
	"context"
	"errors"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// Bounds of a run's cancel.
const (
	// broadcastTimeout bounds the one-hop cancel broadcast to the executors.
	broadcastTimeout = 2 * time.Second
	// decoderWait bounds how long a cancel waits for modelproxy's answer, which comes once
	// its decoders of the run have ended, before it cancels the rest of the tree
	// (cancelWith): a modelproxy slower than this must not hold up the teardown.
	decoderWait = 5 * time.Millisecond
)

// cancelWith records the cancel instant (the first one wins) and cancels the tree, the
// decoders first. A deadline cancel's instant is never later than the deadline itself.
//
// The decoders first: modelproxy is told to cancel the run's decoders, and only once it
// has answered that they have ended (or decoderWait has passed) is the run's context
// cancelled, which starts the hop-by-hop teardown of the rest of the tree, and are
// toolrunner and subagent told. That teardown is tens of milliseconds of CPU across the
// services at 64 leaves; begun at the same time, it kept modelproxy from reading the
// broadcast while its decoders went on spending tokens (docs/benchmarks.md). The loops
// above a decoder that stops first see its CANCELLED while their own context is still
// alive; they take it for the run's cancel on its way and wait for it
// (cancel.AwaitWindow), so every node still records the run's cause, not a failed sibling.
func (rn *run) cancelWith(cause error) { rn.cancelTree(cause, true) }

// cancelTree is cancelWith; decodersFirst false tells every executor at once without
// waiting (a drain cancelling every run).
func (rn *run) cancelTree(cause error, decodersFirst bool) {
	rn.mu.Lock()
	if rn.cancelAt.IsZero() {
		rn.cancelAt = time.Now()
		if errors.Is(cause, cancel.ErrDeadline) && rn.cancelAt.After(rn.dl) {
			rn.cancelAt = rn.dl
		}
	}
	first := !rn.broadcasted
	rn.broadcasted = true
	rn.mu.Unlock()
	if first && rn.broadcast != nil {
		rn.broadcast(cause, decodersFirst)
	}
	rn.cancel(cause)
}

// markCancel records the cancel instant (the first one wins) without cancelling
// anything: the chaos setting orphan, whose summary still splits tokens at the instant
// the client left.
func (rn *run) markCancel() {
	rn.mu.Lock()
	if rn.cancelAt.IsZero() {
		rn.cancelAt = time.Now()
	}
	rn.mu.Unlock()
}

// disconnected handles the end of a Run call's stream before its run ended.
func (s *Server) disconnected(ctx context.Context, rn *run, req *orchestratorv1.RunRequest) {
	if req.GetContinueOnDisconnect() || rn.moved() {
		// A run that moved is another orchestrator's now: its nodes may be that one's,
		// and a cancel here would reach them.
		return
	}
	if rn.orphan {
		rn.markCancel()
		return
	}
	// A client whose own deadline expired cancels its call a little before the server's
	// copy of the deadline fires (the server measured it from arrival); that is the
	// deadline, not a disconnect.
	if errors.Is(ctx.Err(), context.DeadlineExceeded) || time.Until(rn.dl) <= cancel.DeadlineSlop {
		rn.cancelWith(cancel.ErrDeadline)
		return
	}
	rn.cancelWith(cancel.ErrClientDisconnect)
}

// cancelHere cancels a run this process holds, as an operator, and waits for its tree
// to stop.
func (s *Server) cancelHere(ctx context.Context, rn *run, req *orchestratorv1.CancelRunRequest) (*orchestratorv1.Run, error) {
	if rn.ended() {
		return rn.snapshot(s.shared), nil
	}
	// A caller whose own client went away says so (md.CancelCause): the run's cause is
	// then client_disconnect, as for a Run stream that ended.
	cause, what := cancel.ErrOperator, "run cancelled by operator"
	if clientLeft(ctx) {
		cause, what = cancel.ErrClientDisconnect, "run cancelled: its client left"
	}
	s.cfg.Log.InfoContext(ctx, what, "run_id", rn.id, "reason", req.GetReason())
	if rn.orphan {
		rn.markCancel()
	} else {
		rn.cancelWith(cause)
	}
	select {
	case <-rn.done:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	return rn.snapshot(s.shared), nil
}

// clientLeft reports whether the incoming CancelRun says its caller's client went away
// (md.CancelCause; md.Check admits no other value).
func clientLeft(ctx context.Context) bool {
	v := metadata.ValueFromIncomingContext(ctx, md.CancelCause)
	return len(v) == 1 && strings.TrimSpace(v[0]) == md.CancelCauseClientDisconnect
}

// broadcast is a run's broadcast (see run.broadcast), on the run's context rctx.
func (s *Server) broadcast(rctx context.Context, id string, cause error, decodersFirst bool) {
	first := 0 // the first of the reports told after the decoders
	if decodersFirst && len(s.cfg.Reports) > reportModel+1 {
		first = reportModel + 1
		decoders := make(chan struct{})
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer close(decoders)
			s.broadcastCancel(rctx, id, cause, decoderWait, s.cfg.Reports[reportModel:reportModel+1])
		}()
		t := time.NewTimer(decoderWait)
		select {
		case <-decoders:
		case <-t.C:
		}
		t.Stop()
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.broadcastCancel(rctx, id, cause, 0, s.cfg.Reports[first:])
	}()
}

// broadcastCancel asks the executors of to to cancel the run's running nodes with cause
// and, with settle > 0, to answer once those have ended (at most settle later). The
// RST_STREAM path reaches them too, hop by hop; this reaches a decoder three subagents
// deep in one hop, and tells it the true cause.
func (s *Server) broadcastCancel(rctx context.Context, run string, cause error, settle time.Duration, to []meshv1.NodeReportServiceClient) {
	ctx, stop := context.WithTimeout(context.WithoutCancel(rctx), broadcastTimeout)
	defer stop()
	req := &meshv1.CancelNodesRequest{RunId: run, NodePrefixes: []string{RootNode}, Cause: cancel.FromError(cause)}
	if settle > 0 {
		req.SettleTimeout = durationpb.New(settle)
	}
	var wg sync.WaitGroup
	for _, c := range to {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := c.CancelNodes(ctx, req); err != nil {
				s.cfg.Log.WarnContext(ctx, "cancel broadcast failed; the RST_STREAM path still stops the tree", "run_id", run, "error", err.Error())
			}
		}()
	}
	wg.Wait()
}
