package modelproxy

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider"
)

// route is a resolved model: what streams one call's answer once its decoder's node and
// lease exist. A direct route is one provider (the sim model); a chainRoute is the
// Router's fallback chain for an alias or a provider/model.
type route interface {
	// serve streams the answer of c to its caller, recording its tokens in c.spend. It
	// returns a gRPC status error, or the decoder's context error.
	serve(ctx context.Context, c *call) error
	// provider names the provider that decoded, for the ledger, given the node as it ended.
	provider(ended *meshv1.Node) string
}

// nodeRecorder is where a route records what it learns about a call's node while it runs
// (the provider that serves it, its fallbacks). A *nodes.Table is one.
type nodeRecorder interface {
	Update(runID, id string, fn func(*meshv1.Node)) *meshv1.Node
}

// call is one Generate call being served by a route.
type call struct {
	model     string // as asked for: sim or an alias or provider/model
	req       *modelproxyv1.GenerateRequest
	stream    modelproxyv1.ModelProxyService_GenerateServer
	run, node string // the node table's names of the call's node
	spend     *spend // the decoder's tokens
	nodes     nodeRecorder
	metrics   *Metrics
	decoder   *decoder
	now       func() time.Time // the clock of the tokens' instants
	// maxTokens, when > 0, is the max_tokens a provider is sent for a request without
	// one: the bound the call's budget reservation counted on (DefaultMaxTokens).
	maxTokens int32
}

// providerRequest is req as a provider sees it, for the provider's model.
func providerRequest(model string, req *modelproxyv1.GenerateRequest) *provider.Request {
	return &provider.Request{Model: model, Messages: req.GetMessages(), Notes: req.GetNotes(), Tools: req.GetTools(),
		MaxTokens: int(req.GetMaxTokens()), Temperature: req.Temperature, Seed: req.Seed, Schema: req.GetResponseSchema()}
}

// direct streams one provider's answer to the caller as it comes: no breaker, fallback,
// cache or schema check, and the node's provider fields left unset.
type direct struct {
	p   provider.Provider
	req *provider.Request // the call's request, checked
}

func (d direct) provider(*meshv1.Node) string { return d.p.Name() }

func (d direct) serve(ctx context.Context, c *call) error {
	st, err := d.p.Stream(ctx, d.req)
	if err != nil {
		return err
	}
	detached := c.decoder.open(st)
	counted := c.metrics.counter(c.model, d.p.Name())
	gone := false // a detached decoder's caller has gone: drain, do not send
	for {
		ch, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if ch.Tokens > 0 {
			c.spend.record(c.now(), ch.Tokens, d.p.Name())
			if counted != nil {
				counted.Add(float64(ch.Tokens))
			}
		}
		if p := ch.Usage.GetPromptTokens(); p > 0 {
			c.spend.prompt(p)
			c.metrics.addPrompt(c.model, d.p.Name(), p)
		}
		if gone {
			continue
		}
		if err := c.stream.Send(&modelproxyv1.GenerateResponse{Delta: ch.Delta, Tokens: int32(ch.Tokens), //nolint:gosec // a chunk's tokens, at most one completion's: far below 2^31
			ToolCalls: ch.ToolCalls, FinishReason: ch.FinishReason, Usage: ch.Usage}); err != nil {
			if !detached {
				return err
			}
			gone = true
		}
	}
}

// decoder is the decoding side of a call. It decodes under the node's context unless its
// stream is provider.Detached, which decodes under a context of its own: that context's
// end is then the decoder's outcome, and a lapse of the decoder's lease is passed on to it.
type decoder struct {
	node context.Context

	mu       sync.Mutex
	st       provider.Stream
	detached provider.Detached
	stopped  error // why it was told to stop (its lease lapsed, an operator), or nil
}

// open records the stream the decoder reads and reports whether it is detached.
func (d *decoder) open(st provider.Stream) bool {
	det, ok := st.(provider.Detached)
	d.mu.Lock()
	d.st = st
	if ok {
		d.detached = det
	}
	stopped := d.stopped
	d.mu.Unlock()
	if ok && stopped != nil {
		det.Stop(stopped)
	}
	return ok
}

// lapsed is the lease's lapse hook.
func (d *decoder) lapsed() { d.stop(cancel.ErrLeaseExpired) }

// stop passes a stop with cause (besides the node's cancel, which the caller does) to a
// detached stream, now or when it opens: the first cause stands.
func (d *decoder) stop(cause error) {
	d.mu.Lock()
	if d.stopped == nil {
		d.stopped = cause
	}
	det := d.detached
	d.mu.Unlock()
	if det != nil {
		det.Stop(cause)
	}
}

// context is the context the decoder ran under.
func (d *decoder) context() context.Context {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.detached != nil {
		return d.detached.Context()
	}
	return d.node
}

// close closes the decoder's stream, once its end is recorded.
func (d *decoder) close() {
	d.mu.Lock()
	st := d.st
	d.mu.Unlock()
	if st != nil {
		_ = st.Close()
	}
}
