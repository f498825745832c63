package timeline

import (
	"math"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Timeline is a run's nodes on one time axis; its JSON is what `curfew trace --json`
// prints. Every *_ms figure is milliseconds relative to the run's start (its created_at),
// so scripts need no clock arithmetic; a field is absent when the instant is unknown.
type Timeline struct {
	RunID  string `json:"run_id"`
	Status string `json:"status"`
	Cause  string `json:"cause,omitempty"`
	// StartedAt is the run's start, the axis's zero, in RFC 3339 with nanoseconds.
	StartedAt string `json:"started_at"`
	// DeadlineMS is the run's absolute deadline on the axis.
	DeadlineMS *float64 `json:"deadline_ms,omitempty"`
	// CancelMS is the run's cancel instant (the orchestrator's record), absent when the
	// run was not cancelled.
	CancelMS *float64 `json:"cancel_ms,omitempty"`
	// EndedMS is when the run's summary was complete.
	EndedMS           *float64 `json:"ended_ms,omitempty"`
	Tokens            int64    `json:"tokens"`
	TokensAfterCancel int64    `json:"tokens_after_cancel"`
	// PromptTokens is the run's prompt (input) tokens; Tokens counts output tokens.
	PromptTokens int64  `json:"prompt_tokens"`
	Nodes        []Node `json:"nodes"`
}

// Node is one node of a Timeline.
type Node struct {
	ID     string `json:"id"`
	Depth  int    `json:"depth"`
	Kind   string `json:"kind"`
	Name   string `json:"name"`
	Status string `json:"status"`
	Cause  string `json:"cause,omitempty"`
	// StartMS and EndMS are when the node started and ended (EndMS absent while running).
	StartMS *float64 `json:"start_ms,omitempty"`
	EndMS   *float64 `json:"end_ms,omitempty"`
	// EndAfterCancelMS is EndMS − the run's CancelMS: how long the node ran on after the
	// cancel instant (negative: it had ended before).
	EndAfterCancelMS *float64 `json:"end_after_cancel_ms,omitempty"`
	// CancelledMS is when the node learnt it was cancelled.
	CancelledMS *float64 `json:"cancelled_ms,omitempty"`
	// DeadlineMS is the deadline the node ran under; LeftMS is DeadlineMS − EndMS, the
	// time it had left when it ended.
	DeadlineMS        *float64 `json:"deadline_ms,omitempty"`
	LeftMS            *float64 `json:"left_ms,omitempty"`
	Tokens            int64    `json:"tokens"`
	TokensAfterCancel int64    `json:"tokens_after_cancel"`
	// PromptTokens is a model node's prompt (input) tokens.
	PromptTokens int64 `json:"prompt_tokens,omitempty"`
	Attempts     int   `json:"attempts"`
}

// New lays a run's nodes on the axis of its start.
func New(r *orchestratorv1.Run) *Timeline {
	zero := r.GetCreatedAt().AsTime()
	rel := func(ts *timestamppb.Timestamp) *float64 {
		if ts == nil {
			return nil
		}
		return msPtr(ts.AsTime().Sub(zero))
	}
	tl := &Timeline{
		RunID: r.GetRunId(), Status: Lower(r.GetStatus().String(), "RUN_STATUS_"), StartedAt: zero.UTC().Format(time.RFC3339Nano),
		DeadlineMS: rel(r.GetDeadline()), CancelMS: rel(r.GetCancelledAt()), EndedMS: rel(r.GetEndedAt()),
		Tokens: r.GetTokens(), TokensAfterCancel: r.GetTokensAfterCancel(), PromptTokens: r.GetPromptTokens(), Nodes: []Node{},
	}
	if c := r.GetCause(); c != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		tl.Cause = CauseName(c)
	}
	for _, n := range r.GetNodes() {
		tn := Node{
			ID: n.GetId(), Depth: strings.Count(n.GetId(), "/"), Kind: Lower(n.GetKind().String(), "NODE_KIND_"), Name: n.GetName(),
			Status: Lower(n.GetStatus().String(), "NODE_STATUS_"), StartMS: rel(n.GetStartedAt()), EndMS: rel(n.GetEndedAt()),
			CancelledMS: rel(n.GetCancelledAt()), DeadlineMS: rel(n.GetDeadline()),
			Tokens: n.GetTokens(), TokensAfterCancel: n.GetTokensAfterCancel(), PromptTokens: n.GetPromptTokens(), Attempts: len(n.GetEarlierAttempts()) + 1,
		}
		if c := n.GetCause(); c != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
			tn.Cause = CauseName(c)
		}
		if tn.EndMS != nil && tl.CancelMS != nil {
			tn.EndAfterCancelMS = round(*tn.EndMS - *tl.CancelMS)
		}
		if tn.EndMS != nil && tn.DeadlineMS != nil {
			tn.LeftMS = round(*tn.DeadlineMS - *tn.EndMS)
		}
		tl.Nodes = append(tl.Nodes, tn)
	}
	return tl
}

// Span is the extent of the axis a picture of tl should cover, in milliseconds from the
// run's start: up to the last start or end, the cancel, and now (for nodes still running,
// now is milliseconds from the start; pass 0 for a run that has ended); the deadline too
// unless it lies far beyond (more than 4 times as far: a 10-minute deadline would
// flatten a 2-second run to nothing). Never less than 1.
func (tl *Timeline) Span(now float64) float64 {
	span := now
	grow := func(v *float64) {
		if v != nil && *v > span {
			span = *v
		}
	}
	grow(tl.CancelMS)
	for _, n := range tl.Nodes {
		grow(n.StartMS)
		grow(n.EndMS)
	}
	if d := tl.DeadlineMS; d != nil && *d <= 4*span {
		grow(d)
	}
	return max(span, 1)
}

// CauseName is a cancel cause as curfew prints it: "operator", "client_disconnect".
func CauseName(c meshv1.CancelCause) string { return Lower(c.String(), "CANCEL_CAUSE_") }

// Lower is an enum value's name without its prefix, in lower case: "RUN_STATUS_FAILED"
// with prefix "RUN_STATUS_" is "failed".
func Lower(s, prefix string) string { return strings.ToLower(strings.TrimPrefix(s, prefix)) }

// msPtr returns d in milliseconds, to the microsecond.
func msPtr(d time.Duration) *float64 { return round(float64(d.Microseconds()) / 1000) }

func round(ms float64) *float64 {
	v := math.Round(ms*1000) / 1000
	return &v
}
