package admin

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/retrywindow"
)

// The coordinated limits other than admission's (docs/cluster.md, "In status"), as
// StatusResponse.coordination carries them: this orchestrator's retry windows and
// breakers' probe leases, then each modelproxy replica's (ListDecoders).

// Parts of a Coordination.
const (
	PartRetryWindow  = "retry_window"
	PartBreakerProbe = "breaker_probe"
	PartBudget       = "budget"
)

// ownCoordination is this orchestrator's retry windows, then its coordinated breakers,
// each by target.
func (s *Server) ownCoordination(now time.Time) []*adminv1.Coordination {
	var out []*adminv1.Coordination
	if h := s.cfg.RetryWindows; h != nil {
		st := h.Status()
		w := h.Window()
		for _, target := range sortedKeys(st) {
			out = append(out, s.retryWindow(target, st[target], w.Replicas, w.Length, now))
		}
	}
	if s.cfg.Breakers != nil {
		for _, b := range s.cfg.Breakers.All() {
			pc, ok := b.ProbeCoordination()
			if !ok {
				continue
			}
			out = append(out, s.probe(b.Target(), pc, now))
		}
	}
	return out
}

func (s *Server) retryWindow(target string, ts retrywindow.TargetStatus, replicas int, length time.Duration, now time.Time) *adminv1.Coordination {
	c := &adminv1.Coordination{Service: "orchestrator", Replica: s.cfg.Replica, Part: PartRetryWindow, Target: target,
		Degraded: ts.StoreDown, Held: ts.Held, Refused: ts.Refused}
	windows := fmt.Sprintf("%d window(s) of %v across replicas", replicas, length)
	switch {
	case ts.StoreDown:
		c.Since = timestamppb.New(ts.DownSince)
		c.Detail = "store unreachable: retries that need a window are refused"
	case ts.Held:
		c.Until = timestamppb.New(ts.Until)
		c.Detail = fmt.Sprintf("window %d (epoch %d) held for %v of %s", ts.Slot, ts.Epoch, ts.Until.Sub(now).Round(time.Millisecond), windows)
	default:
		c.Detail = "no window held; " + windows
	}
	if ts.Refused > 0 {
		c.Detail += fmt.Sprintf("; %d retries refused", ts.Refused)
	}
	return c
}

func (s *Server) probe(target string, pc breaker.ProbeCoordination, now time.Time) *adminv1.Coordination {
	c := &adminv1.Coordination{Service: "orchestrator", Replica: s.cfg.Replica, Part: PartBreakerProbe, Target: target,
		Degraded: pc.Degraded, Held: pc.Held, Detail: pc.Detail(now)}
	if !pc.DegradedSince.IsZero() {
		c.Since = timestamppb.New(pc.DegradedSince)
	}
	if !pc.ElsewhereUntil.IsZero() {
		c.Until = timestamppb.New(pc.ElsewhereUntil)
	}
	return c
}

// fromModelproxy is a modelproxy replica's Coordination as the admin API carries it.
func fromModelproxy(replica string, m *modelproxyv1.Coordination) *adminv1.Coordination {
	c := &adminv1.Coordination{Service: "modelproxy", Replica: m.GetReplica(), Part: m.GetPart(), Target: m.GetTarget(),
		Degraded: m.GetDegraded(), Detail: m.GetDetail(), Since: m.GetSince(), Held: m.GetHeld(), Until: m.GetUntil(),
		Refused: m.GetRefused()}
	if c.Replica == "" {
		c.Replica = replica
	}
	return c
}

// sortCoordination orders by replica, part and target.
func sortCoordination(cs []*adminv1.Coordination) {
	slices.SortStableFunc(cs, func(a, b *adminv1.Coordination) int {
		return strings.Compare(a.GetReplica()+"\x00"+a.GetPart()+"\x00"+a.GetTarget(), b.GetReplica()+"\x00"+b.GetPart()+"\x00"+b.GetTarget())
	})
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
