package chaos

import (
	"context"
	"errors"
	"fmt"

	"github.com/curfew-mesh/curfew/mesh/cancel"
	meshchaos "github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/sim"
)

// Provider is the sim model with the drill's decoder faults: under orphan and drop-cancel
// its streams are provider.Detached, and under no-dedupe an attempt that the plan's
// model_error fails leaves a decoder running.
type Provider struct {
	provider.Provider
	// leave starts the decoder left running by the failed attempt of ctx.
	leave func(ctx context.Context)
}

// Check implements provider.Checker with the wrapped provider's check, if it has one.
func (p *Provider) Check(req *provider.Request) error {
	if c, ok := p.Provider.(provider.Checker); ok {
		return c.Check(req)
	}
	return nil
}

// Stream implements provider.Provider.
func (p *Provider) Stream(ctx context.Context, req *provider.Request) (provider.Stream, error) {
	if leftover(ctx) {
		return p.detached(sim.WithoutModelError(ctx), req, true)
	}
	cs := meshchaos.From(ctx)
	var (
		st  provider.Stream
		err error
	)
	if cs.Orphan || cs.DropCancel {
		st, err = p.detached(ctx, req, !cs.Orphan) // drop-cancel: the lease still stops it
	} else {
		st, err = p.Provider.Stream(ctx, req)
	}
	var injected *sim.InjectedError
	if cs.NoDedupe && errors.As(err, &injected) && p.leave != nil {
		p.leave(ctx)
	}
	return st, err
}

// detached starts a stream that decodes on a context detached from ctx's cancel, bounded
// by its deadline; a lapse of the decoder's lease stops it when byLease is set.
func (p *Provider) detached(ctx context.Context, req *provider.Request, byLease bool) (provider.Stream, error) {
	dctx, stop := detach(ctx)
	st, err := p.Provider.Stream(dctx, req)
	if err != nil {
		stop(nil)
		return nil, err
	}
	return &detachedStream{Stream: st, ctx: dctx, stop: stop, byLease: byLease}, nil
}

// detachedStream is a provider.Detached stream.
type detachedStream struct {
	provider.Stream
	ctx     context.Context
	stop    context.CancelCauseFunc
	byLease bool
}

func (d *detachedStream) Context() context.Context { return d.ctx }

func (d *detachedStream) Stop(cause error) {
	if d.byLease {
		d.stop(cause)
	}
}

func (d *detachedStream) Close() error {
	err := d.Stream.Close()
	d.stop(nil)
	return err
}

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

type leftoverKey struct{}

// leftoverContext is the context of the Generate call of the decoder that the failed
// attempt of ctx leaves running: detached from ctx's cancel, its node NODE~aN.
func leftoverContext(ctx context.Context) (context.Context, context.CancelCauseFunc) {
	lctx, stop := detach(ctx)
	id := md.IdentityFrom(ctx)
	node := id.NodeID
	if node == "" {
		node = "unattributed" // as modelproxy names it
	}
	id.NodeID = fmt.Sprintf("%s~a%d", node, max(id.Attempt, 1))
	lctx = md.WithIdentity(lctx, id)
	return context.WithValue(lctx, leftoverKey{}, true), stop
}

func leftover(ctx context.Context) bool {
	v, _ := ctx.Value(leftoverKey{}).(bool)
	return v
}
