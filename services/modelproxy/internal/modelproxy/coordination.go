package modelproxy

import (
	"fmt"
	"slices"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/budget"
)

// coordination is this replica's coordinated limits as ListDecoders reports them
// (docs/cluster.md, "In status"): the token budgets when they are held in the store
// (budget.Shared), then each provider breaker whose probe is coordinated, by provider.
func (s *Server) coordination(now time.Time) []*modelproxyv1.Coordination {
	var out []*modelproxyv1.Coordination
	if sh, ok := s.Budgets.(interface{ Status() budget.SharedStatus }); ok {
		out = append(out, s.budgetCoordination(sh.Status()))
	}
	if s.Router == nil {
		return out
	}
	names := make([]string, 0, len(s.Router.providers))
	for name := range s.Router.providers {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		pc, ok := s.Router.Breaker(name).ProbeCoordination()
		if !ok {
			continue
		}
		c := &modelproxyv1.Coordination{Service: "modelproxy", Replica: s.Replica, Part: "breaker_probe", Target: name,
			Degraded: pc.Degraded, Held: pc.Held, Detail: pc.Detail(now)}
		if !pc.DegradedSince.IsZero() {
			c.Since = timestamppb.New(pc.DegradedSince)
		}
		if !pc.ElsewhereUntil.IsZero() {
			c.Until = timestamppb.New(pc.ElsewhereUntil)
		}
		out = append(out, c)
	}
	return out
}

func (s *Server) budgetCoordination(st budget.SharedStatus) *modelproxyv1.Coordination {
	c := &modelproxyv1.Coordination{Service: "modelproxy", Replica: s.Replica, Part: "budget", Degraded: st.Degraded,
		Detail: "reservations in the store, across replicas"}
	if st.Degraded {
		c.Since = timestamppb.New(st.DegradedSince)
		c.Detail = fmt.Sprintf("store unreachable: reserving against this replica's share, (budget - used) / %d replicas", max(st.Replicas, 1))
	}
	if st.Pending > 0 {
		c.Detail += fmt.Sprintf("; %d settlements to charge when the store is back", st.Pending)
	}
	return c
}
