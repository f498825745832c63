package modelproxy

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
)

// The decoders this replica runs, as operators see them (ListDecoders, CancelDecoders)
// and as the operators' controls act on them (controls.go). Every Generate call that
// gets as far as a decoder is in the table from just after its node begins until it
// ends, with or without a lease: a decoder whose caller asked for no lease is still one
// an operator may need to stop.

// liveDecoder is one decoder in the table. Its fields are fixed at its start, except what
// its spend and lease say as it runs.
type liveDecoder struct {
	tenant, run, node, retry string
	pool                     string // the run's admission pool (curfew-pool), "" when not said
	model                    string
	rt                       route
	started                  time.Time
	spend                    *spend
	lease                    *lease // nil without one
	dec                      *decoder
	node0                    context.Context // the node's context: done once it is cancelled
}

// decoderTable holds the live decoders. The zero value is ready to use.
type decoderTable struct {
	mu sync.Mutex
	m  map[*liveDecoder]struct{}
}

func (t *decoderTable) add(d *liveDecoder) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[*liveDecoder]struct{}{}
	}
	t.m[d] = struct{}{}
}

func (t *decoderTable) remove(d *liveDecoder) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.m, d)
}

// list returns the live decoders that match keep (all when nil), oldest first.
func (t *decoderTable) list(keep func(*liveDecoder) bool) []*liveDecoder {
	t.mu.Lock()
	out := make([]*liveDecoder, 0, len(t.m))
	for d := range t.m {
		if keep == nil || keep(d) {
			out = append(out, d)
		}
	}
	t.mu.Unlock()
	slices.SortFunc(out, func(a, b *liveDecoder) int {
		if c := a.started.Compare(b.started); c != 0 {
			return c
		}
		return strings.Compare(a.run+"\x00"+a.node, b.run+"\x00"+b.node)
	})
	return out
}

// stopDecoder cancels d's node with cause (the way a CancelNodes does) and tells a
// detached stream too. It reports whether d was still running undisturbed: false when
// its node had been cancelled already (a cancelled decoder that still drains is not
// cancelled twice in the log).
func (s *Server) stopDecoder(d *liveDecoder, cause error) bool {
	if d.node0.Err() != nil {
		d.dec.stop(cause) // a detached stream may still be decoding
		return false
	}
	s.Nodes.Cancel(d.run, []string{d.node}, cause)
	d.dec.stop(cause)
	return true
}

// decoderProto is d as ListDecoders reports it, at now.
func (s *Server) decoderProto(d *liveDecoder) *modelproxyv1.Decoder {
	out := &modelproxyv1.Decoder{
		Replica: s.Replica, Tenant: d.tenant, RunId: d.run, NodeId: d.node, Model: d.model, Pool: d.pool,
		StartedAt: timestamppb.New(d.started), LastHeartbeat: timestamppb.New(d.started),
		Tokens: d.spend.output.Load(),
	}
	if last := s.Leases.lastRenewal(d.lease); !last.IsZero() {
		out.LastHeartbeat = timestamppb.New(last)
	}
	if n := s.Nodes.Update(d.run, d.node, func(*meshv1.Node) {}); n != nil {
		out.Provider = d.rt.provider(n)
	}
	if out.Provider == "" {
		if dr, ok := d.rt.(direct); ok {
			out.Provider = dr.p.Name()
		}
	}
	return out
}

// olderThan reads a request's older_than: 0 when unset.
func olderThan(d *durationpb.Duration) (time.Duration, error) {
	if d == nil {
		return 0, nil
	}
	if err := d.CheckValid(); err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "older_than: %v", err)
	}
	v := d.AsDuration()
	if v < 0 {
		return 0, status.Errorf(codes.InvalidArgument, "older_than must not be negative, got %v", v)
	}
	return v, nil
}

// startedBefore selects the decoders started before cut.
func startedBefore(cut time.Time) func(*liveDecoder) bool {
	return func(d *liveDecoder) bool { return d.started.Before(cut) }
}

// ListDecoders implements ModelProxyService: this replica's decoders started longer ago
// than older_than (all when unset), oldest first, its provider breakers and its
// coordinated limits (token budgets, provider probe leases). The mesh
// policy lets only the orchestrator call it (the operators' API fans it out).
func (s *Server) ListDecoders(_ context.Context, req *modelproxyv1.ListDecodersRequest) (*modelproxyv1.ListDecodersResponse, error) {
	age, err := olderThan(req.GetOlderThan())
	if err != nil {
		return nil, err
	}
	var keep func(*liveDecoder) bool
	if age > 0 {
		keep = startedBefore(s.now().Add(-age))
	}
	out := &modelproxyv1.ListDecodersResponse{Replica: s.Replica, Breakers: s.breakerStates(), Coordination: s.coordination(time.Now())}
	for _, d := range s.decoders.list(keep) {
		out.Decoders = append(out.Decoders, s.decoderProto(d))
	}
	return out, nil
}

// CancelDecoders implements ModelProxyService: it cancels, with cause operator, this
// replica's decoders started longer ago than older_than, and names them. older_than is
// required and positive: cancelling every decoder of a replica is asked for explicitly,
// with a small bound (1ms), never by leaving the field out.
func (s *Server) CancelDecoders(ctx context.Context, req *modelproxyv1.CancelDecodersRequest) (*modelproxyv1.CancelDecodersResponse, error) {
	age, err := olderThan(req.GetOlderThan())
	if err != nil {
		return nil, err
	}
	if age <= 0 {
		return nil, status.Error(codes.InvalidArgument, "older_than is required and must be positive: give 1ms to cancel every decoder")
	}
	out := &modelproxyv1.CancelDecodersResponse{Replica: s.Replica}
	// Every decoder listed is still decoding, including one whose node was cancelled
	// before but which went on (a lost cancel, the drill's fault 1): stopping those is
	// what this call is for, so each is named.
	for _, d := range s.decoders.list(startedBefore(s.now().Add(-age))) {
		p := s.decoderProto(d)
		s.stopDecoder(d, cancel.ErrOperator)
		out.Cancelled = append(out.Cancelled, p)
	}
	if len(out.Cancelled) > 0 {
		s.log().InfoContext(ctx, "decoders cancelled by an operator", "older_than", age.String(), "cancelled", len(out.Cancelled), "reason", req.GetReason())
	}
	return out, nil
}

// breakerStates returns the state of every provider's breaker on this replica, by
// provider: closed, open or half_open. None without a providers file.
func (s *Server) breakerStates() []*modelproxyv1.ProviderBreaker {
	if s.Router == nil {
		return nil
	}
	names := make([]string, 0, len(s.Router.providers))
	for name := range s.Router.providers {
		names = append(names, name)
	}
	slices.Sort(names)
	out := make([]*modelproxyv1.ProviderBreaker, 0, len(names))
	for _, name := range names {
		st := s.Router.Breaker(name).State().Name()
		out = append(out, &modelproxyv1.ProviderBreaker{Provider: name, State: st})
	}
	return out
}
