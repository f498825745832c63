package console

import (
	"fmt"
	"math"
	"strings"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/timeline"
)

// The timeline's geometry, in SVG user units.
const (
	labelW = 300 // the node labels' column
	chartW = 640 // the axis
	rowH   = 24
	headH  = 34 // the axis labels and the lines' names above the first row
	barH   = 14
)

// runView is what the run page's live part shows: the run's figures, its timeline as
// SVG geometry and its nodes as a table. Every colour has its words beside it: a bar's
// status is written in its row.
type runView struct {
	Run      *orchestratorv1.Run
	TL       *timeline.Timeline
	Tenant   string
	Live     bool
	SpanMS   float64
	Width    int
	Height   int
	ChartX   int
	ChartW   int
	Rows     []viewRow
	Deadline *vline
	Cancel   *vline
	Ticks    []vline
	// DeadlineUnixMS is the run's deadline for the page's countdown; 0 when unknown.
	DeadlineUnixMS int64
	Text           string // the newest model text (the answer, streaming in)
	Pending        map[string]*meshv1.ApprovalGate
	CanChange      bool
	Admin          bool
	CSRF           string
}

// viewRow is one node: its label, its bar, and its earlier attempts' bars.
type viewRow struct {
	timeline.Node
	Y, TextY  int
	Label     string
	BarX      float64
	BarW      float64
	Class     string
	State     string // status, and cause when there is one, in words
	Earlier   []bar
	Gate      *meshv1.ApprovalGate
	Open      bool // still running
	TextLabel string
	// StateX is where the row's status is written: after its bar, or before it when the
	// bar reaches the right edge.
	StateX float64
}

type bar struct {
	X, W float64
	Y    int
}

// BarY is where an earlier attempt's thin bar of a row goes: under the row's bar.
func (v *runView) BarY(b bar) int { return b.Y }

// vline is a vertical line across the rows at an instant.
type vline struct {
	X     float64
	Label string
}

// newRunView lays run out; now is the instant a running node's bar reaches.
func newRunView(run *orchestratorv1.Run, now time.Time, text string, pending map[string]*meshv1.ApprovalGate) *runView {
	tl := timeline.New(run)
	live := run.GetEndedAt() == nil
	var nowMS float64
	if live {
		nowMS = float64(now.Sub(run.GetCreatedAt().AsTime()).Microseconds()) / 1000
	}
	span := tl.Span(nowMS)
	x := func(ms float64) float64 {
		return math.Round((labelW+math.Max(0, math.Min(ms, span))/span*chartW)*10) / 10
	}
	v := &runView{Run: run, TL: tl, Tenant: run.GetTenant(), Live: live, SpanMS: span, ChartX: labelW, ChartW: chartW,
		Width: labelW + chartW + 10, Height: headH + rowH*len(tl.Nodes) + 6, Text: text, Pending: pending}
	if d := run.GetDeadline(); d != nil {
		v.DeadlineUnixMS = d.AsTime().UnixMilli()
	}
	if d := tl.DeadlineMS; d != nil {
		// A deadline far beyond the run's activity is not on the axis (timeline.Span):
		// its line stands at the right edge, and its label says it lies beyond.
		v.Deadline = &vline{X: x(*d), Label: fmt.Sprintf("deadline +%s", ms(*d))}
		if *d > span {
			v.Deadline.Label += " (beyond the axis) →"
		}
	}
	if c := tl.CancelMS; c != nil {
		v.Cancel = &vline{X: x(*c), Label: fmt.Sprintf("cancel +%s", ms(*c))}
	}
	for i := 0; i <= 4; i++ {
		at := span * float64(i) / 4
		v.Ticks = append(v.Ticks, vline{X: x(at), Label: ms(at)})
	}
	byID := map[string]*meshv1.Node{}
	for _, n := range run.GetNodes() {
		byID[n.GetId()] = n
	}
	for i, n := range tl.Nodes {
		y := headH + i*rowH
		row := viewRow{Node: n, Y: y + (rowH-barH)/2, TextY: y + rowH/2 + 4, Class: "st-" + n.Status, State: n.Status}
		row.Label = strings.Repeat("  ", n.Depth) + n.ID[strings.LastIndexByte(n.ID, '/')+1:]
		if n.Name != "" && n.Name != row.Label {
			row.Label += " " + n.Name
		}
		if n.Cause != "" {
			row.State += " (" + n.Cause + ")"
		}
		if n.Attempts > 1 {
			row.State += fmt.Sprintf(", attempt %d", n.Attempts)
		}
		if g := pending[n.ID]; g != nil && g.GetState() == "pending" {
			row.Gate = g
			row.State += ", waiting for approval"
		}
		start, end := 0.0, nowMS
		if n.StartMS != nil {
			start = *n.StartMS
		}
		if n.EndMS != nil {
			end = *n.EndMS
		} else {
			row.Open = live
			if !live {
				end = span
			}
		}
		row.BarX = x(start)
		row.BarW = math.Max(2, x(end)-row.BarX)
		for _, a := range byID[n.ID].GetEarlierAttempts() {
			if a.GetStartedAt() == nil || a.GetEndedAt() == nil {
				continue
			}
			zero := run.GetCreatedAt().AsTime()
			s := float64(a.GetStartedAt().AsTime().Sub(zero).Microseconds()) / 1000
			e := float64(a.GetEndedAt().AsTime().Sub(zero).Microseconds()) / 1000
			row.Earlier = append(row.Earlier, bar{X: x(s), W: math.Max(2, x(e)-x(s)), Y: row.Y + barH + 1})
		}
		row.TextLabel = row.Label + ": " + row.State
		row.StateX = row.BarX + row.BarW + 4
		if row.StateX > labelW+chartW-120 {
			row.StateX = labelW + chartW - 120
		}
		v.Rows = append(v.Rows, row)
	}
	return v
}

// ms formats milliseconds on the axis: "850ms", "12.4s".
func ms(v float64) string {
	if math.Abs(v) < 1000 {
		return fmt.Sprintf("%.0fms", v)
	}
	return fmt.Sprintf("%.1fs", v/1000)
}

// fmtMS formats an optional instant of the axis; "–" when unknown.
func fmtMS(v *float64) string {
	if v == nil {
		return "–"
	}
	return fmt.Sprintf("%+.0fms", *v)
}
