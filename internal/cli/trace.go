package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/timeline"
)

// DefaultTraceWidth is the width of the timeline bars of `curfew trace`, in columns.
const DefaultTraceWidth = 48

// Timeline is what `curfew trace --json` prints (package timeline's, which the web
// console draws too).
type Timeline = timeline.Timeline

// TimelineNode is one node of a Timeline.
type TimelineNode = timeline.Node

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
func NewTimeline(r *orchestratorv1.Run) *Timeline { return timeline.New(r) }

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

	// The axis spans the run's activity (timeline.Span: the deadline only when it is not
	// far beyond the rest).
	span := tl.Span(0)
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
