package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// DefaultTraceWidth is the width of the timeline bars of `curfew trace`, in columns.
const DefaultTraceWidth = 48

// Timeline is what `curfew trace --json` prints: a run's nodes on one time axis. Every
// *_ms figure is milliseconds relative to the run's start (its created_at), so scripts
// need no clock arithmetic; a field is absent when the instant is unknown.
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
	PromptTokens int64          `json:"prompt_tokens"`
	Nodes        []TimelineNode `json:"nodes"`
}

// TimelineNode is one node of a Timeline.
type TimelineNode struct {
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

func cmdTrace(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("trace", stderr)
	var c common
	c.register(fs)
	width := fs.Int("width", DefaultTraceWidth, "columns of the timeline bars")
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "trace", err)
	}
	if len(pos) != 1 {
		return usageErr(stderr, "trace", errors.New("give one RUN id"))
	}
	if *width < 10 || *width > 400 {
		return usageErr(stderr, "trace", errors.New("--width must be between 10 and 400"))
	}
	run, code := c.getRun(ctx, stderr, "trace", pos[0])
	if run == nil {
		return code
	}
	tl := NewTimeline(run)
	if c.json {
		b, err := json.Marshal(tl)
		if err != nil {
			return callErr(stderr, "trace", err)
		}
		fmt.Fprintln(stdout, string(b))
		return ExitOK
	}
	printTimeline(stdout, tl, *width)
	return ExitOK
}

// NewTimeline lays a run's nodes on the axis of its start.
func NewTimeline(r *orchestratorv1.Run) *Timeline {
	zero := r.GetCreatedAt().AsTime()
	rel := func(ts *timestamppb.Timestamp) *float64 {
		if ts == nil {
			return nil
		}
		return msPtr(ts.AsTime().Sub(zero))
	}
	tl := &Timeline{
		RunID: r.GetRunId(), Status: lower(r.GetStatus().String(), "RUN_STATUS_"), StartedAt: zero.UTC().Format(time.RFC3339Nano),
		DeadlineMS: rel(r.GetDeadline()), CancelMS: rel(r.GetCancelledAt()), EndedMS: rel(r.GetEndedAt()),
		Tokens: r.GetTokens(), TokensAfterCancel: r.GetTokensAfterCancel(), PromptTokens: r.GetPromptTokens(), Nodes: []TimelineNode{},
	}
	if c := r.GetCause(); c != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		tl.Cause = causeName(c)
	}
	for _, n := range r.GetNodes() {
		tn := TimelineNode{
			ID: n.GetId(), Depth: strings.Count(n.GetId(), "/"), Kind: lower(n.GetKind().String(), "NODE_KIND_"), Name: n.GetName(),
			Status: lower(n.GetStatus().String(), "NODE_STATUS_"), StartMS: rel(n.GetStartedAt()), EndMS: rel(n.GetEndedAt()),
			CancelledMS: rel(n.GetCancelledAt()), DeadlineMS: rel(n.GetDeadline()),
			Tokens: n.GetTokens(), TokensAfterCancel: n.GetTokensAfterCancel(), PromptTokens: n.GetPromptTokens(), Attempts: len(n.GetEarlierAttempts()) + 1,
		}
		if c := n.GetCause(); c != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
			tn.Cause = causeName(c)
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

// msPtr returns d in milliseconds, to the microsecond.
func msPtr(d time.Duration) *float64 { return round(float64(d.Microseconds()) / 1000) }

func round(ms float64) *float64 {
	v := math.Round(ms*1000) / 1000
	return &v
}

// fmtMS formats an axis instant: "+1503ms", "-" when unknown.
func fmtMS(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%+.0fms", *v)
}

// printTimeline draws the timeline: a header with the deadline and the cancel instant,
// then one row per node, indented by depth, with its figures and a bar from its start to
// its end. On the bars' axis '|' marks the cancel instant (':' where a bar covers it)
// and 'D' the deadline when it falls within the axis.
func printTimeline(w io.Writer, tl *Timeline, width int) {
	fmt.Fprintf(w, "run %s  %s", tl.RunID, tl.Status)
	if tl.Cause != "" {
		fmt.Fprintf(w, " (cause %s)", tl.Cause)
	}
	fmt.Fprintf(w, "  started %s\n", tl.StartedAt)
	fmt.Fprintf(w, "deadline %s   cancel %s   tokens %d   tokens after cancel %d   prompt tokens %d\n", fmtMS(tl.DeadlineMS), fmtMS(tl.CancelMS),
		tl.Tokens, tl.TokensAfterCancel, tl.PromptTokens)

	// The axis spans the run's activity: up to the last end or the cancel, and the
	// deadline too unless it lies far beyond (more than 4 times as far: a 10-minute
	// deadline would flatten a 2-second run to nothing).
	var span float64
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
	if span <= 0 {
		span = 1
	}
	col := func(v float64) int {
		c := int(math.Round(v / span * float64(width-1)))
		return max(0, min(width-1, c))
	}
	cancelCol, deadlineCol := -1, -1
	if tl.CancelMS != nil {
		cancelCol = col(*tl.CancelMS)
	}
	if d := tl.DeadlineMS; d != nil && *d <= span {
		deadlineCol = col(*d)
	}
	fmt.Fprintf(w, "%-34s %-9s %-28s %9s %9s %12s %9s %6s %6s  %s\n", "NODE", "KIND", "STATUS", "START", "END", "AFTER_CANCEL", "LEFT", "TOKENS", "AFTER",
		fmt.Sprintf("0 .. %.0fms", span))
	for _, n := range tl.Nodes {
		bar := []byte(strings.Repeat(" ", width))
		if deadlineCol >= 0 {
			bar[deadlineCol] = 'D'
		}
		if n.StartMS != nil {
			end := span
			if n.EndMS != nil {
				end = *n.EndMS
			}
			for i := col(*n.StartMS); i <= col(end); i++ {
				bar[i] = '='
			}
		}
		if cancelCol >= 0 {
			if bar[cancelCol] == '=' {
				bar[cancelCol] = ':'
			} else {
				bar[cancelCol] = '|'
			}
		}
		id := strings.Repeat("  ", n.Depth) + n.ID[strings.LastIndexByte(n.ID, '/')+1:]
		status := n.Status
		if n.Cause != "" {
			status += "/" + n.Cause
		}
		fmt.Fprintf(w, "%-34s %-9s %-28s %9s %9s %12s %9s %6d %6d  %s\n", id, n.Kind, status, fmtMS(n.StartMS), fmtMS(n.EndMS),
			fmtMS(n.EndAfterCancelMS), fmtMS(n.LeftMS), n.Tokens, n.TokensAfterCancel, strings.TrimRight(string(bar), " "))
	}
}
