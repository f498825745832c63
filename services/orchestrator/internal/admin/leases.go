package admin

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
)

// Decoders reaches every modelproxy replica: decoder leases live in each replica's
// memory, so the lease methods ask them all. A *replicas.Set (mesh/replicas) is one.
type Decoders interface {
	// Conns returns a connection to every modelproxy replica.
	Conns(ctx context.Context) []*grpc.ClientConn
}

// FanoutTimeout bounds one replica's answer to a lease fan-out: a replica slower than
// this is named unreachable rather than holding up the answer.
const FanoutTimeout = 2 * time.Second

// replicaAnswer is one replica's answer to a fan-out, or its error.
type replicaAnswer[T any] struct {
	target string
	resp   T
	err    error
}

// fanout calls call on every modelproxy replica at once, each bounded by FanoutTimeout,
// and returns the answers and the replicas that did not answer, each named
// "modelproxy <address>: <error>", sorted.
func fanout[T any](ctx context.Context, d Decoders, call func(context.Context, modelproxyv1.ModelProxyServiceClient) (T, error)) (answers []T, unreachable []string) {
	if d == nil {
		return nil, nil
	}
	conns := d.Conns(ctx)
	out := make([]replicaAnswer[T], len(conns))
	var wg sync.WaitGroup
	for i, cc := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, FanoutTimeout)
			defer cancel()
			resp, err := call(cctx, modelproxyv1.NewModelProxyServiceClient(cc))
			out[i] = replicaAnswer[T]{target: cc.Target(), resp: resp, err: err}
		}()
	}
	wg.Wait()
	for _, a := range out {
		if a.err != nil {
			unreachable = append(unreachable, "modelproxy "+a.target+": "+status.Convert(a.err).Message())
			continue
		}
		answers = append(answers, a.resp)
	}
	slices.Sort(unreachable)
	return answers, unreachable
}

// leaseOf is a modelproxy decoder as a Lease, with its age at now.
func leaseOf(d *modelproxyv1.Decoder, now time.Time) *adminv1.Lease {
	l := &adminv1.Lease{
		Replica: d.GetReplica(), Tenant: d.GetTenant(), RunId: d.GetRunId(), NodeId: d.GetNodeId(),
		Model: d.GetModel(), Provider: d.GetProvider(), StartedAt: d.GetStartedAt(),
		LastHeartbeat: d.GetLastHeartbeat(), Tokens: d.GetTokens(),
	}
	if d.GetStartedAt() != nil {
		l.Age = durationpb.New(max(0, now.Sub(d.GetStartedAt().AsTime())))
	}
	return l
}

// oldestFirst sorts leases by start, then replica, run and node.
func oldestFirst(ls []*adminv1.Lease) {
	slices.SortFunc(ls, func(a, b *adminv1.Lease) int {
		if c := a.GetStartedAt().AsTime().Compare(b.GetStartedAt().AsTime()); c != 0 {
			return c
		}
		return strings.Compare(a.GetReplica()+"\x00"+a.GetRunId()+"\x00"+a.GetNodeId(), b.GetReplica()+"\x00"+b.GetRunId()+"\x00"+b.GetNodeId())
	})
}

// fleetView is what the modelproxy replicas answered: their decoders as Leases, oldest
// first, their provider breakers (service modelproxy), their coordinated limits, and
// the replicas that did not answer.
type fleetView struct {
	leases       []*adminv1.Lease
	breakers     []*adminv1.BreakerState
	coordination []*adminv1.Coordination
	unreachable  []string
}

// fleet asks every modelproxy replica for its decoders started longer ago than
// olderThan (every one when 0). For Status and ListLeases.
func (s *Server) fleet(ctx context.Context, olderThan time.Duration) fleetView {
	req := &modelproxyv1.ListDecodersRequest{}
	if olderThan > 0 {
		req.OlderThan = durationpb.New(olderThan)
	}
	answers, unreachable := fanout(ctx, s.cfg.Decoders, func(ctx context.Context, c modelproxyv1.ModelProxyServiceClient) (*modelproxyv1.ListDecodersResponse, error) {
		return c.ListDecoders(ctx, req)
	})
	v := fleetView{unreachable: unreachable}
	now := time.Now()
	for _, a := range answers {
		for _, d := range a.GetDecoders() {
			v.leases = append(v.leases, leaseOf(d, now))
		}
		for _, b := range a.GetBreakers() {
			v.breakers = append(v.breakers, &adminv1.BreakerState{Service: "modelproxy", Replica: a.GetReplica(), Target: b.GetProvider(), State: b.GetState()})
		}
		for _, c := range a.GetCoordination() {
			v.coordination = append(v.coordination, fromModelproxy(a.GetReplica(), c))
		}
	}
	oldestFirst(v.leases)
	slices.SortFunc(v.breakers, func(a, b *adminv1.BreakerState) int {
		return strings.Compare(a.GetReplica()+"\x00"+a.GetTarget(), b.GetReplica()+"\x00"+b.GetTarget())
	})
	sortCoordination(v.coordination)
	return v
}

// optionalAge reads an optional older_than: 0 when unset.
func optionalAge(field string, d *durationpb.Duration) (time.Duration, error) {
	if d == nil {
		return 0, nil
	}
	if err := d.CheckValid(); err != nil {
		return 0, invalid("%s: %v", field, err)
	}
	v := d.AsDuration()
	if v < 0 {
		return 0, invalid("%s must not be negative, got %v", field, v)
	}
	return v, nil
}

// ListLeases implements adminv1.AdminServiceServer: the decoder leases of every
// modelproxy replica, oldest first; a replica that does not answer is named in
// unreachable instead of failing the call.
func (s *Server) ListLeases(ctx context.Context, req *adminv1.ListLeasesRequest) (*adminv1.ListLeasesResponse, error) {
	age, err := optionalAge("older_than", req.GetOlderThan())
	if err != nil {
		return nil, err
	}
	v := s.fleet(ctx, age)
	leases, unreachable := v.leases, v.unreachable
	return &adminv1.ListLeasesResponse{Leases: leases, Unreachable: unreachable}, nil
}

// CancelLeases implements adminv1.AdminServiceServer: every modelproxy replica cancels
// its decoders started longer ago than older_than, with cause operator. older_than is
// required and positive (cancelling every decoder is asked for with a small bound, such
// as 1ms). Repeating it cancels what has grown old since; the decoders already cancelled
// are not named again.
func (s *Server) CancelLeases(ctx context.Context, req *adminv1.CancelLeasesRequest) (*adminv1.CancelLeasesResponse, error) {
	age, err := optionalAge("older_than", req.GetOlderThan())
	if err != nil {
		return nil, err
	}
	if age <= 0 {
		return nil, invalid("older_than is required and must be positive (give 1ms to cancel every decoder)")
	}
	mreq := &modelproxyv1.CancelDecodersRequest{OlderThan: durationpb.New(age), Reason: req.GetReason()}
	answers, unreachable := fanout(ctx, s.cfg.Decoders, func(ctx context.Context, c modelproxyv1.ModelProxyServiceClient) (*modelproxyv1.CancelDecodersResponse, error) {
		return c.CancelDecoders(ctx, mreq)
	})
	out := &adminv1.CancelLeasesResponse{Unreachable: unreachable}
	now := time.Now()
	for _, a := range answers {
		for _, d := range a.GetCancelled() {
			out.Cancelled = append(out.Cancelled, leaseOf(d, now))
		}
	}
	oldestFirst(out.Cancelled)
	target := "leases older than " + age.String()
	if len(unreachable) > 0 {
		target += " (unreachable: " + strings.Join(unreachable, "; ") + ")"
	}
	if err := s.audit(ctx, "CancelLeases", target, req.GetReason(), req); err != nil {
		return nil, err
	}
	return out, nil
}
