package drill

import (
	"sort"
	"strings"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

// computeRow fills row's figures from the run's summary: its model nodes (decoders)
// with their ledger figures split at the run's cancel instant (the client's, as the
// orchestrator recorded it), else at cancelAt.
func computeRow(row *Row, run *orchestratorv1.Run, cancelAt time.Time, cfg Config) {
	row.RunID = run.GetRunId()
	if run.GetCancelledAt() != nil {
		cancelAt = run.GetCancelledAt().AsTime()
	}
	var main *meshv1.Node
	var stopped []string
	byRetry := map[string][]span{}
	end := func(ts interface{ AsTime() time.Time }, ok bool) time.Time {
		if !ok {
			return time.Now() // still running
		}
		return ts.AsTime()
	}
	for _, n := range run.GetNodes() {
		if n.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL {
			continue
		}
		row.Decoders++
		row.TokensAtCancel += n.GetTokensAtCancel()
		row.TokensAtDeadline += n.GetTokens()
		row.TokensAfterCancel += n.GetTokensAfterCancel()
		row.OrphanTokenDelta += nodes.OrphanTokens(n)
		if main == nil || (!strings.Contains(n.GetId(), "~") && strings.Contains(main.GetId(), "~")) {
			main = n
		}
		if n.GetTokensAfterCancel() > 0 || (n.GetEndedAt() != nil && n.GetEndedAt().AsTime().After(cancelAt.Add(time.Second))) {
			stopped = append(stopped, causeName(n.GetCause()))
		}
		if rid := n.GetRetryId(); rid != "" {
			byRetry[rid] = append(byRetry[rid], span{n.GetStartedAt().AsTime(), end(n.GetEndedAt(), n.GetEndedAt() != nil)})
			for _, a := range n.GetEarlierAttempts() {
				byRetry[rid] = append(byRetry[rid], span{a.GetStartedAt().AsTime(), end(a.GetEndedAt(), a.GetEndedAt() != nil)})
			}
		}
	}
	if main != nil {
		row.RetryID = main.GetRetryId()
		if main.GetDeadline() != nil && main.GetStartedAt() != nil {
			row.DeadlineSlackMS = main.GetDeadline().AsTime().Sub(main.GetStartedAt().AsTime()).Milliseconds()
		}
		row.LeaseAgeMS = leaseAge(main, cancelAt, cfg).Milliseconds()
	}
	for _, spans := range byRetry {
		row.DuplicateInFlight = max(row.DuplicateInFlight, maxOverlap(spans)-1)
	}
	sort.Strings(stopped)
	row.StoppedBy = strings.Join(dedupe(stopped), ",")
	row.ShedReason = causeName(run.GetCause())
	if row.ShedReason == "-" {
		row.ShedReason = ""
	}
}

// leaseAge is the age of the decoder's lease renewal at the cancel instant, derived from
// the keeper's rule (renewed every min(heartbeat, remaining/3) from the decoder's start;
// every fault-2 period under slow-heartbeat): modelproxy does not report renewals per
// decoder. 0 when the decoder had ended by then.
func leaseAge(n *meshv1.Node, cancelAt time.Time, cfg Config) time.Duration {
	if n.GetStartedAt() == nil || n.GetStartedAt().AsTime().After(cancelAt) {
		return 0
	}
	if n.GetEndedAt() != nil && n.GetEndedAt().AsTime().Before(cancelAt) {
		return 0
	}
	last := n.GetStartedAt().AsTime()
	var dl time.Time
	if n.GetDeadline() != nil {
		dl = n.GetDeadline().AsTime()
	}
	for i := 0; i < 10000; i++ {
		p := cfg.Heartbeat
		if cfg.Fault == 2 {
			p = cfg.SlowHeartbeat
		} else if !dl.IsZero() {
			p = min(p, dl.Sub(last)/3)
		}
		p = max(p, 50*time.Millisecond)
		if last.Add(p).After(cancelAt) {
			break
		}
		last = last.Add(p)
	}
	return cancelAt.Sub(last)
}

// span is when one decoder (an attempt) ran.
type span struct{ start, end time.Time }

// maxOverlap is the most spans open at one instant.
func maxOverlap(spans []span) int {
	type ev struct {
		at    time.Time
		delta int
	}
	var evs []ev
	for _, s := range spans {
		evs = append(evs, ev{s.start, 1}, ev{s.end, -1})
	}
	sort.Slice(evs, func(i, j int) bool {
		if evs[i].at.Equal(evs[j].at) {
			return evs[i].delta < evs[j].delta // an end before a start at the same instant
		}
		return evs[i].at.Before(evs[j].at)
	})
	cur, best := 0, 0
	for _, e := range evs {
		cur += e.delta
		best = max(best, cur)
	}
	return best
}

func dedupe(s []string) []string {
	var out []string
	for i, v := range s {
		if i == 0 || v != s[i-1] {
			out = append(out, v)
		}
	}
	return out
}

// causeName is a cancel cause as the rows show it: "client_disconnect", "-" for none.
func causeName(c meshv1.CancelCause) string {
	if c == meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		return "-"
	}
	return strings.ToLower(strings.TrimPrefix(c.String(), "CANCEL_CAUSE_"))
}
