package modelproxy

import (
	"context"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/sim"
)

// SimModel is the name of the built-in simulated model (package sim).
const SimModel = sim.Name

// unattributed keys work that arrived without a run id (for example from grpcurl).
const unattributed = "unattributed"

// Server implements ModelProxyService and, for its decoders, NodeReportService.
type Server struct {
	modelproxyv1.UnimplementedModelProxyServiceServer
	Nodes  *nodes.Table
	Ledger *Ledger
	// Sim is the provider of the built-in sim model (package sim, from New).
	Sim provider.Provider
	// Router serves every model other than sim; nil serves sim only.
	Router *Router
	// LedgerKey, if set, names the run and node a decoder of model is keyed by in the
	// ledger, in memory and in the store, given the call's own (run is "" in the store's
	// key for a call without a run id). nil keys it by the call's run and node.
	LedgerKey func(ctx context.Context, model, run, node string) (string, string)
	// Metrics, if set, count the tokens decoders emit and, per summary, the orphan tokens.
	Metrics *Metrics
	// Store persists the ledger: each decoder's tokens are queued while it streams
	// (every spendCheckpoint) and when it ends, and appended in batches (persist.go). A service without a durable store gives a
	// process-private one (memory://). Call Flush before closing it.
	Store LedgerStore
	// Log receives the appends that failed and the leases that lapsed; nil is
	// slog.Default().
	Log *slog.Logger
	// Budgets, if set, reserves each call's prompt and max_tokens against its tenant's
	// token budget before the call starts, and settles to its spend when it ends
	// (budget.go); nil reserves nothing.
	Budgets budget.Budgets
	// Leases is the decoder lease table (lease.go); its TTL is the default of decoders
	// whose caller names none (DefaultLeaseTTL from New; 0 gives those no lease).
	Leases *Leases
	// Replica names this replica in ListDecoders and CancelDecoders answers.
	Replica string
	// persister keys and tracks the appends in flight.
	persister persister
	// checkpoint is how often a streaming decoder queues its spend (spendCheckpoint);
	// tests may change it.
	checkpoint time.Duration
	// decoders are the decoders running (decoders.go).
	decoders decoderTable
	// controls are the operators' controls last read by WatchControls (controls.go); nil
	// before the first read: nothing is frozen or drained.
	controls atomic.Pointer[controlSet]
	// now is the clock; tests may replace it.
	now func() time.Time
}

// New returns a server with an empty node table and ledger, and the sim model, that
// persists its ledger to st.
//
// Its node table keeps a run's records nodes.DefaultRetention after it ended; a caller
// that wants another retention replaces Nodes before serving.
func New(st LedgerStore) *Server {
	s := &Server{Nodes: nodes.New(0), Ledger: NewLedger(), Sim: sim.New(), Store: st, persister: persister{nonce: newNonce(), delay: persistDelay},
		checkpoint: spendCheckpoint, now: time.Now}
	s.Leases = newLeases(DefaultLeaseTTL, s.leaseLapsed)
	return s
}

// Report returns the NodeReportService of this server's decoders, with token figures
// read from the ledger.
func (s *Server) Report() *nodes.Server {
	return &nodes.Server{Table: s.Nodes, Summarized: s.Metrics.summarized, Decorate: func(run string, req *meshv1.ListNodesRequest, n *meshv1.Node) {
		var at time.Time
		if req.GetCancelAt() != nil {
			at = req.GetCancelAt().AsTime()
		}
		n.Tokens, n.TokensAtCancel, n.TokensAfterCancel = s.Ledger.Figures(run, n.GetId(), at)
		n.PromptTokens = s.Ledger.Prompt(run, n.GetId())
		if at.IsZero() {
			n.TokensAtCancel = 0
		}
	}}
}

// Sweep forgets runs whose decoders all ended longer ago than the table's retention.
func (s *Server) Sweep(now time.Time) {
	s.Nodes.Sweep(now)
	live := map[string]bool{}
	for _, r := range s.Nodes.Runs() {
		live[r] = true
	}
	for _, r := range s.Ledger.Runs() {
		if !live[r] {
			s.Ledger.Forget(r)
		}
	}
}

// Generate implements ModelProxyService: it runs one model step as a streamed decode. It
// resolves the model to a route, records the decoder's node and lease, lets the route
// stream the answer, and records the decoder's tokens in the ledger.
func (s *Server) Generate(req *modelproxyv1.GenerateRequest, stream modelproxyv1.ModelProxyService_GenerateServer) error {
	ctx := stream.Context()
	model := req.GetModel()
	if model == "" {
		model = SimModel
	}
	rt, err := s.resolve(model, req)
	if err != nil {
		return err
	}
	ttl, err := s.Leases.requestTTL(req.GetLeaseTtl(), "lease_ttl")
	if err != nil {
		return err
	}
	id := md.IdentityFrom(ctx)
	run, node := orUnattributed(id.RunID), orUnattributed(id.NodeID)
	if err := ctx.Err(); err != nil {
		return err // never start a decoder for a call already cancelled
	}
	tenant := id.Tenant
	if tenant == "" {
		tenant = md.DefaultTenant
	}
	// Nor for a frozen run or tenant, or a drained pool (controls.go).
	if err := s.refuse(tenant, run, id.Pool); err != nil {
		return err
	}
	n := &meshv1.Node{Id: node, Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: model}
	if dl, ok := ctx.Deadline(); ok {
		n.Deadline = timestamppb.New(dl)
	}
	// Nor for a call of a run whose cancel (CancelNodes) came first.
	bctx, _, err := s.Nodes.BeginLive(ctx, run, n)
	if err != nil {
		return cancelledRun(err)
	}
	ctx = bctx
	lrun, lnode := s.ledgerKey(ctx, model, run, node)
	prun, _ := s.ledgerKey(ctx, model, id.RunID, node) // the store's: "" without a run id
	key := s.decoderKey(ctx, prun, lnode)
	// The tenant's budget covers the call's prompt and max_tokens, or it does not start:
	// its node ends at once, failed with the refusal, and no provider is asked. The hold
	// names the decoder's parts in the durable ledger: if this process dies before it
	// settles, the hold is charged them when it lapses.
	hold, bound, err := s.reserve(budget.WithLedger(ctx, prun, key), tenant, rt, req)
	if err != nil {
		s.Nodes.Finish(ctx, run, node, err, nil)
		return err
	}
	dec := &decoder{node: ctx}
	defer dec.close()
	lease := s.Leases.holdWith(leaseKey{tenant, run, node, id.RetryID}, ttl, dec.lapsed)
	tokens := s.traceTokens(ctx, run, node)
	sp := s.newSpend(ctx, lrun, lnode, prun, key)
	// In the operators' view from here to its end; a control read between the check
	// above and now stops it at the next read (applyControls).
	live := &liveDecoder{tenant: tenant, run: run, node: node, retry: id.RetryID, pool: id.Pool, model: model, rt: rt,
		started: s.now(), spend: sp, lease: lease, dec: dec, node0: ctx}
	s.decoders.add(live)
	err = rt.serve(ctx, &call{model: model, req: req, stream: stream, run: run, node: node, spend: sp,
		nodes: s.Nodes, metrics: s.Metrics, decoder: dec, now: s.now, maxTokens: bound})
	s.Leases.end(lease)
	s.decoders.remove(live)
	dctx := dec.context()
	err = leaseErr(dctx, err)
	hold.Settle(sp.spent) // to what the ledger recorded, however the call ended
	tokens.end()
	ended := s.Nodes.Finish(dctx, run, node, err, func(n *meshv1.Node) {
		if dctx.Err() != nil {
			n.CancelledAt = timestamppb.New(s.now())
		}
	})
	sp.end(rt.provider(ended)) // the last part of its spend, queued for the store
	return err
}

// resolve returns the route of model, after the checks that refuse a request before any
// decoder starts: NOT_FOUND for a model not served, the sim model's plan errors.
func (s *Server) resolve(model string, req *modelproxyv1.GenerateRequest) (route, error) {
	if model == SimModel {
		d := direct{p: s.Sim, req: providerRequest(model, req)}
		if c, ok := s.Sim.(provider.Checker); ok {
			if err := c.Check(d.req); err != nil {
				return nil, err
			}
		}
		return d, nil
	}
	if s.Router != nil {
		if rt, ok := s.Router.resolve(model); ok {
			return rt, nil
		}
	}
	return nil, status.Errorf(codes.NotFound, "unknown model %q (configured: %s)", model, strings.Join(s.models(), ", "))
}

// ledgerKey is the run and node a decoder's tokens are keyed by in the ledger: the call's
// own, unless LedgerKey says otherwise.
func (s *Server) ledgerKey(ctx context.Context, model, run, node string) (string, string) {
	if s.LedgerKey == nil {
		return run, node
	}
	return s.LedgerKey(ctx, model, run, node)
}

// orUnattributed is id, or unattributed when it is empty.
func orUnattributed(id string) string {
	if id == "" {
		return unattributed
	}
	return id
}

// ListModels lists sim and the aliases of the route table, by name, each with its chain's
// first provider and model. The names of the form provider/model, served too, are not
// listed: they are the file's plumbing, the aliases its interface.
func (s *Server) ListModels(context.Context, *modelproxyv1.ListModelsRequest) (*modelproxyv1.ListModelsResponse, error) {
	resp := &modelproxyv1.ListModelsResponse{Models: []*modelproxyv1.ModelInfo{{Name: SimModel}}}
	if s.Router == nil {
		return resp, nil
	}
	aliases := s.Router.Aliases()
	for _, a := range slices.Sorted(maps.Keys(aliases)) {
		if a == SimModel {
			continue // sim is always the built-in model (resolve)
		}
		t := aliases[a]
		resp.Models = append(resp.Models, &modelproxyv1.ModelInfo{Name: a, Provider: t.Provider, ProviderModel: t.Model})
	}
	return resp, nil
}

// models lists the model names served, sim first.
func (s *Server) models() []string {
	out := []string{SimModel}
	if s.Router != nil {
		ms := s.Router.Models()
		slices.Sort(ms)
		out = append(out, ms...)
	}
	return out
}
