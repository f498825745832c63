package modelproxy

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/chaos"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// SimModel is the name of the built-in simulated model.
const SimModel = "sim"

// unattributed keys work that arrived without a run id (for example from grpcurl).
const unattributed = "unattributed"

// Server implements ModelProxyService and, for its decoders, NodeReportService.
type Server struct {
	modelproxyv1.UnimplementedModelProxyServiceServer
	Nodes  *nodes.Table
	Ledger *Ledger
	// Router serves every model other than sim; nil serves sim only.
	Router *Router
	// Metrics, if set, count the tokens decoders emit and, per summary, the orphan tokens.
	Metrics *Metrics
	// Store, if set, persists the ledger: each decoder's tokens are queued when it ends
	// and appended in batches (see persist). nil keeps the ledger in memory only. Call
	// Flush before closing it.
	Store LedgerStore
	// Log receives the appends that failed and the leases that lapsed; nil is
	// slog.Default().
	Log *slog.Logger
	// Leases is the decoder lease table (lease.go); its TTL is the default of decoders
	// whose caller names none (DefaultLeaseTTL from New; 0 gives those no lease).
	Leases *Leases
	// persister keys and tracks the appends in flight.
	persister persister
	// now is the clock; tests may replace it.
	now func() time.Time
}

// New returns a server with an empty node table and ledger.
func New() *Server {
	s := &Server{Nodes: nodes.New(0), Ledger: NewLedger(), persister: persister{nonce: newNonce(), delay: persistDelay}, now: time.Now}
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

// Generate implements ModelProxyService: it runs one model step as a streamed decode.
func (s *Server) Generate(req *modelproxyv1.GenerateRequest, stream modelproxyv1.ModelProxyService_GenerateServer) error {
	ctx := stream.Context()
	model := req.GetModel()
	if model == "" {
		model = SimModel
	}
	var (
		rt   *route
		step *step
		err  error
	)
	if model == SimModel {
		if step, err = simStep(req.GetMessages()); err != nil {
			return err
		}
	} else {
		ok := false
		if s.Router != nil {
			rt, ok = s.Router.resolve(model)
		}
		if !ok {
			return status.Errorf(codes.NotFound, "unknown model %q (configured: %s)", model, strings.Join(s.models(), ", "))
		}
	}
	ttl, err := s.Leases.requestTTL(req.GetLeaseTtl(), "lease_ttl")
	if err != nil {
		return err
	}
	id := md.IdentityFrom(ctx)
	run, node := id.RunID, id.NodeID
	if run == "" {
		run = unattributed
	}
	if node == "" {
		node = unattributed
	}
	if err := ctx.Err(); err != nil {
		return err // never start a decoder for a call already cancelled
	}
	n := &meshv1.Node{Id: node, Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: model}
	if dl, ok := ctx.Deadline(); ok {
		n.Deadline = timestamppb.New(dl)
	}
	ctx, _ = s.Nodes.Begin(ctx, run, n)
	tenant := id.Tenant
	if tenant == "" {
		tenant = md.DefaultTenant
	}
	// The drill's chaos settings (package chaos; empty unless modelproxy runs with
	// --chaos), sim model only: see chaos.go.
	cs := chaos.From(ctx)
	if rt != nil {
		cs = chaos.Settings{}
	}
	if step != nil {
		step.fails = step.ModelError.Fails(max(id.Attempt, 1), rand.Float64)
		if step.fails && cs.NoDedupe {
			s.leaveDecoder(ctx, run, node, tenant, ttl, step, cs)
		}
	}
	dctx, stopDecoder := ctx, context.CancelCauseFunc(nil)
	var onLapse func()
	if cs.Orphan || cs.DropCancel {
		dctx, stopDecoder = detach(ctx)
		defer stopDecoder(nil)
		stream = &quietStream{ModelProxyService_GenerateServer: stream}
		if !cs.Orphan { // drop-cancel: the lease still stops it
			onLapse = func() { stopDecoder(cancel.ErrLeaseExpired) }
		}
	}
	lease := s.Leases.holdWith(leaseKey{tenant, run, node, id.RetryID}, ttl, onLapse)
	tokens := s.traceTokens(ctx, run, node)
	sp := s.newSpend(ctx, ledgerRun(run, cs), ledgerNode(node, cs))
	if rt != nil {
		err = s.Router.generate(ctx, s, rt, req, stream, sp)
	} else {
		err = s.decode(dctx, stream, sp, step)
	}
	s.Leases.end(lease)
	err = leaseErr(dctx, err)
	output, orphan := sp.end()
	tokens.end()
	ended := s.Nodes.Finish(dctx, run, node, err, func(n *meshv1.Node) {
		if dctx.Err() != nil {
			n.CancelledAt = timestamppb.New(s.now())
		}
	})
	provider := ended.GetProvider()
	if rt == nil {
		provider = SimModel
	}
	s.persist(ledgerCtx(ctx, cs), ledgerNode(node, cs), provider, output, orphan)
	return err
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

type step struct {
	plan  *plan.Plan
	index int
	plan.Step
	fails bool // the step's model_error fault fails this attempt
}

// simStep parses the plan from the conversation's first user message and picks the step
// from the number of assistant turns so far.
func simStep(msgs []*modelproxyv1.Message) (*step, error) {
	var task string
	turns := 0
	for _, m := range msgs {
		switch m.GetRole() {
		case modelproxyv1.Role_ROLE_USER:
			if task == "" {
				task = m.GetContent()
			}
		case modelproxyv1.Role_ROLE_ASSISTANT:
			turns++
		}
	}
	if task == "" {
		return nil, status.Error(codes.InvalidArgument, "sim model: the conversation has no user message with a plan")
	}
	p, err := plan.Parse([]byte(task))
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "sim model: %v", err)
	}
	if turns >= len(p.Steps) {
		return nil, status.Errorf(codes.InvalidArgument, "sim model: the conversation has %d assistant turns but the plan has %d steps", turns, len(p.Steps))
	}
	return &step{plan: p, index: turns, Step: p.Steps[turns]}, nil
}

var words = []string{"the", "deadline", "reaches", "every", "leaf", "and", "the", "tree", "stops"}

// decode emits the step's tokens at the plan's rate, on an absolute schedule so that the
// rate does not drift, stopping at the next token boundary when ctx is done.
func (s *Server) decode(ctx context.Context, stream modelproxyv1.ModelProxyService_GenerateServer, sp *spend, st *step) error {
	attempt := md.IdentityFrom(ctx).Attempt
	if attempt == 0 {
		attempt = 1
	}
	if f := st.ModelError; st.fails {
		code := codes.Unavailable
		if f.Code != "" {
			code, _ = plan.ParseCode(f.Code)
		}
		return status.Errorf(code, "sim model: injected error on attempt %d of %d", attempt, f.Attempts)
	}
	n := st.ThinkTokens
	if st.AnswerTokens > 0 {
		n = st.AnswerTokens
	}
	interval := time.Duration(float64(time.Second) / st.plan.TPS())
	start := s.now().Add(time.Duration(st.FirstTokenDelayMS) * time.Millisecond)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	counted := s.Metrics.counter(SimModel, SimProvider)
	for i := 0; i < n; i++ {
		due := start.Add(time.Duration(i+1) * interval)
		if wait := due.Sub(s.now()); wait > 0 {
			timer.Reset(wait)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-timer.C:
			}
		}
		// Both may be ready at once and select picks at random: a cancelled decoder must
		// not emit the token it was waiting for.
		if err := ctx.Err(); err != nil {
			return err
		}
		sp.record(s.now(), 1)
		if counted != nil {
			counted.Inc()
		}
		if err := stream.Send(&modelproxyv1.GenerateResponse{Delta: words[i%len(words)] + " ", Tokens: 1}); err != nil {
			return err
		}
	}
	final := &modelproxyv1.GenerateResponse{Usage: &modelproxyv1.Usage{CompletionTokens: int64(n)}}
	if st.AnswerTokens > 0 {
		final.FinishReason = "stop"
	} else {
		final.FinishReason = "tool_calls"
		for j, t := range st.Tools {
			args := string(t.Args)
			if args == "" {
				args = "{}"
			}
			final.ToolCalls = append(final.ToolCalls, &modelproxyv1.ToolCall{Id: fmt.Sprintf("call_%d_%d", st.index, j), Name: t.Name, ArgsJson: args,
				IdempotencyKey: t.IdempotencyKey})
		}
	}
	return stream.Send(final)
}
