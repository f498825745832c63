package replicas

import (
	"context"
	"errors"
	"slices"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
)

// NodeReports returns a NodeReportServiceClient that calls every replica of s in
// parallel: CancelNodes reaches a run's nodes on whichever replica runs them (and
// returns the sum cancelled), ListNodes lists them all (see merge) and is settled only
// when every replica says so. A replica that fails is left out (the others' answer
// stands, not settled, and the failure is logged); only when every replica fails is the
// call an error, the first one's.
func NodeReports(s *Set) meshv1.NodeReportServiceClient { return reports{s} }

type reports struct{ s *Set }

// each calls fn on every replica's client in parallel and returns the answers of those
// that succeeded, in no particular order, and the first error.
func each[T any](ctx context.Context, s *Set, fn func(meshv1.NodeReportServiceClient) (T, error)) ([]T, int, error) {
	conns := s.Conns(ctx)
	if len(conns) == 0 {
		return nil, 0, errors.New("replicas: no replica of " + s.target + " to call")
	}
	var (
		mu    sync.Mutex
		out   []T
		first error
		wg    sync.WaitGroup
	)
	for _, c := range conns {
		wg.Go(func() {
			v, err := fn(meshv1.NewNodeReportServiceClient(c))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if first == nil {
					first = err
				}
				s.log.WarnContext(ctx, "replicas: a replica's node report failed; the answer leaves it out", "target", s.target, "replica", c.Target(), "error", err.Error())
				return
			}
			out = append(out, v)
		})
	}
	wg.Wait()
	failed := len(conns) - len(out)
	if len(out) == 0 {
		return nil, failed, first
	}
	return out, failed, nil
}

func (r reports) CancelNodes(ctx context.Context, req *meshv1.CancelNodesRequest, opts ...grpc.CallOption) (*meshv1.CancelNodesResponse, error) {
	resps, _, err := each(ctx, r.s, func(c meshv1.NodeReportServiceClient) (*meshv1.CancelNodesResponse, error) {
		return c.CancelNodes(ctx, req, opts...)
	})
	if err != nil {
		return nil, err
	}
	var n int32
	for _, resp := range resps {
		n += resp.GetCancelled()
	}
	return &meshv1.CancelNodesResponse{Cancelled: n}, nil
}

func (r reports) ListNodes(ctx context.Context, req *meshv1.ListNodesRequest, opts ...grpc.CallOption) (*meshv1.ListNodesResponse, error) {
	resps, failed, err := each(ctx, r.s, func(c meshv1.NodeReportServiceClient) (*meshv1.ListNodesResponse, error) {
		return c.ListNodes(ctx, req, opts...)
	})
	if err != nil {
		return nil, err
	}
	settled := failed == 0
	lists := make([][]*meshv1.Node, 0, len(resps))
	for _, resp := range resps {
		settled = settled && resp.GetSettled()
		lists = append(lists, resp.GetNodes())
	}
	return &meshv1.ListNodesResponse{Nodes: merge(lists), Settled: settled}, nil
}

// merge joins the replicas' lists of one service into one. A node is on one replica,
// except when its attempts ran on several (a retry goes to any replica): the record of
// the latest attempt (highest attempt number, then latest start) stands, and its token
// figures are the sums over the replicas, each of which counts only what its own
// executor spent. Notes (records of kind UNSPECIFIED a canceller left) are kept apart
// from executors' records, one per node, for nodes.Merge. Order is by id.
func merge(lists [][]*meshv1.Node) []*meshv1.Node {
	if len(lists) == 1 {
		return lists[0]
	}
	byID := map[string]*meshv1.Node{}
	var ids []string
	for _, l := range lists {
		for _, n := range l {
			key := n.GetId()
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_UNSPECIFIED {
				key += "\x00note"
			}
			cur, ok := byID[key]
			if !ok {
				byID[key] = n
				ids = append(ids, key)
				continue
			}
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_UNSPECIFIED {
				continue // one note per node is enough
			}
			latest, other := cur, n
			if later(n, cur) {
				latest, other = n, cur
			}
			m := proto.Clone(latest).(*meshv1.Node)
			m.Tokens += other.GetTokens()
			m.TokensAtCancel += other.GetTokensAtCancel()
			m.TokensAfterCancel += other.GetTokensAfterCancel()
			if s := other.GetStartedAt(); s != nil && (m.GetStartedAt() == nil || s.AsTime().Before(m.GetStartedAt().AsTime())) {
				m.StartedAt = s
			}
			byID[key] = m
		}
	}
	slices.Sort(ids)
	out := make([]*meshv1.Node, 0, len(ids))
	for _, id := range ids {
		out = append(out, byID[id])
	}
	return out
}

// later reports whether a is a later attempt of its node than b.
func later(a, b *meshv1.Node) bool {
	if a.GetAttempt() != b.GetAttempt() {
		return a.GetAttempt() > b.GetAttempt()
	}
	return a.GetStartedAt().AsTime().After(b.GetStartedAt().AsTime())
}
