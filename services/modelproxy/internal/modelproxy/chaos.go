package modelproxy

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// The drill's chaos settings (package mesh/chaos, docs/drill.md), honoured only when
// modelproxy runs with --chaos (the server chain clears the header otherwise), and only
// for the sim model. Each breaks one defence on purpose:
//
//   - orphan: the decoder ignores its call's cancel and its lease, and decodes on a context
//     detached from the call but bounded by the call's deadline.
//   - drop-cancel: the decoder ignores its call's cancel (the RST_STREAM and the cancel
//     broadcast); its lease still stops it when it lapses.
//   - worker-ledger: the decoder's tokens go to the ledger under this worker (host, pid),
//     not under the task (run, node).
//   - no-dedupe: an attempt failed by the plan's model_error leaves its decoder running,
//     as a node of its own (NODE~aN), which the retry of the same retry-id does not
//     supersede; nothing renews its lease, so the lease lapse stops it.

// detach returns a context for a decoder that ignores its call's cancel: it keeps ctx's
// values, ends at ctx's deadline (cause deadline), and otherwise only when stop is called.
func detach(ctx context.Context) (context.Context, context.CancelCauseFunc) {
	d := context.WithoutCancel(ctx)
	stopDL := context.CancelFunc(func() {})
	if dl, ok := ctx.Deadline(); ok {
		d, stopDL = context.WithDeadlineCause(d, dl, cancel.ErrDeadline)
	}
	d, stop := context.WithCancelCause(d)
	return d, func(cause error) { stop(cause); stopDL() }
}

// quietStream is the stream of a decoder that outlives its call: once a send fails (the
// call has gone), it stops sending and carries on decoding.
type quietStream struct {
	modelproxyv1.ModelProxyService_GenerateServer
	gone bool
}

func (q *quietStream) Send(r *modelproxyv1.GenerateResponse) error {
	if q.gone {
		return nil
	}
	if err := q.ModelProxyService_GenerateServer.Send(r); err != nil {
		q.gone = true
	}
	return nil
}

// discardStream is the stream of a decoder nobody reads (no-dedupe's leftover).
type discardStream struct {
	modelproxyv1.ModelProxyService_GenerateServer
}

func (discardStream) Send(*modelproxyv1.GenerateResponse) error { return nil }

// ledgerRun and ledgerNode key a decoder's tokens in the ledger: by task, or by worker
// under worker-ledger.
func ledgerRun(run string, cs chaos.Settings) string {
	if cs.WorkerLedger {
		return chaos.Worker()
	}
	return run
}

func ledgerNode(node string, cs chaos.Settings) string {
	if cs.WorkerLedger {
		return "decoder"
	}
	return node
}

// ledgerCtx is ctx with the identity the persisted ledger entry is keyed by.
func ledgerCtx(ctx context.Context, cs chaos.Settings) context.Context {
	if !cs.WorkerLedger {
		return ctx
	}
	id := md.IdentityFrom(ctx)
	id.RunID = chaos.Worker()
	return md.WithIdentity(ctx, id)
}

// leaveDecoder starts, for an attempt about to fail (no-dedupe), the decoder that a
// provider would leave running after its caller gave up on the attempt: node NODE~aN of
// the run, same retry-id, decoding the step in the background until its deadline or its
// lease's lapse (its caller renews the retry's lease, never this one).
func (s *Server) leaveDecoder(ctx context.Context, run, node, tenant string, ttl time.Duration, st *step, cs chaos.Settings) {
	id := md.IdentityFrom(ctx)
	left := fmt.Sprintf("%s~a%d", node, max(id.Attempt, 1))
	n := &meshv1.Node{Id: left, Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: SimModel}
	dctx, stop := detach(ctx)
	if dl, ok := dctx.Deadline(); ok {
		n.Deadline = timestamppb.New(dl)
	}
	// The node's context (which the cancel broadcast reaches) is not the decoder's: the
	// leftover ignores every cancel but its lease's and its deadline.
	_, _ = s.Nodes.Begin(dctx, run, n)
	lease := s.Leases.holdWith(leaseKey{tenant, run, left, id.RetryID}, ttl, func() { stop(cancel.ErrLeaseExpired) })
	cp := *st
	cp.fails = false
	go func() {
		defer stop(nil)
		sp := s.newSpend(dctx, ledgerRun(run, cs), ledgerNode(left, cs))
		err := s.decode(dctx, discardStream{}, sp, &cp)
		s.Leases.end(lease)
		err = leaseErr(dctx, err)
		output, orphan := sp.end()
		s.Nodes.Finish(dctx, run, left, err, func(n *meshv1.Node) {
			if dctx.Err() != nil {
				n.CancelledAt = timestamppb.New(s.now())
			}
		})
		s.persist(ledgerCtx(dctx, cs), ledgerNode(left, cs), SimModel, output, orphan)
	}()
}
