package chaos

import (
	"context"
	"sync"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	meshchaos "github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/modelproxy"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/sim"
)

// Wire puts the drill's faults into srv: its sim model wrapped by Provider and its ledger
// keyed by LedgerKey. It returns the service to register in srv's place, which remembers
// each call's request for the decoder a no-dedupe attempt leaves running.
func Wire(srv *modelproxy.Server) modelproxyv1.ModelProxyServiceServer {
	svc := &service{Server: srv, calls: map[callKey]*modelproxyv1.GenerateRequest{}}
	srv.Sim = &Provider{Provider: srv.Sim, leave: svc.leave}
	srv.LedgerKey = LedgerKey
	return svc
}

// LedgerKey is modelproxy.Server.LedgerKey under worker-ledger: a sim decoder's tokens are
// keyed by this worker (mesh/chaos.Worker) and node "decoder", not by the call's run and
// node.
func LedgerKey(ctx context.Context, model, run, node string) (string, string) {
	if model == sim.Name && meshchaos.From(ctx).WorkerLedger {
		return meshchaos.Worker(), "decoder"
	}
	return run, node
}

// service is the ModelProxyService of a modelproxy with chaos: the server's, remembering
// each Generate call's request while it runs.
type service struct {
	*modelproxy.Server

	mu    sync.Mutex
	calls map[callKey]*modelproxyv1.GenerateRequest
}

// callKey names a Generate call by its identity.
type callKey struct {
	tenant, run, node, retry string
	attempt                  int
}

func keyOf(ctx context.Context) callKey {
	id := md.IdentityFrom(ctx)
	return callKey{id.Tenant, id.RunID, id.NodeID, id.RetryID, id.Attempt}
}

// Generate implements ModelProxyService.
func (s *service) Generate(req *modelproxyv1.GenerateRequest, stream modelproxyv1.ModelProxyService_GenerateServer) error {
	k := keyOf(stream.Context())
	s.mu.Lock()
	s.calls[k] = req
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		if s.calls[k] == req {
			delete(s.calls, k)
		}
		s.mu.Unlock()
	}()
	return s.Server.Generate(req, stream)
}

// leave starts, for the attempt of ctx that its step's model_error just failed, the
// decoder a provider would leave running after its caller gave up on the attempt: a
// Generate of the same request nobody reads, as node NODE~aN of the run with the same
// retry-id, whose decoder ignores every cancel but its lease's lapse and its deadline.
func (s *service) leave(ctx context.Context) {
	s.mu.Lock()
	req := s.calls[keyOf(ctx)]
	s.mu.Unlock()
	if req == nil {
		return // not a call of this service
	}
	lctx, stop := leftoverContext(ctx)
	go func() {
		defer stop(nil)
		_ = s.Server.Generate(req, discard{ctx: lctx}) //nolint:contextcheck // the stream carries lctx
	}()
}

// discard is the stream of a Generate call nobody reads.
type discard struct {
	modelproxyv1.ModelProxyService_GenerateServer
	ctx context.Context
}

func (d discard) Context() context.Context                { return d.ctx }
func (discard) Send(*modelproxyv1.GenerateResponse) error { return nil }
