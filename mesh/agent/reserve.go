package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// DefaultPartialMargin is how long before its deadline a loop with Input.Partial stops
// its work, so that the partial answer it then returns still reaches its caller (a
// subagent's answer crosses toolrunner to the caller's loop).
const DefaultPartialMargin = 100 * time.Millisecond

// Result is how a loop ended without an error.
type Result struct {
	// Answer is the model's answer; when Partial, what the loop had instead.
	Answer string
	// Partial reports that the loop ran out of time before its model answered (only
	// with Input.Partial): Answer is its model's text so far, or else its last tools'
	// results, and no finished answer.
	Partial bool
}

// times are a loop's instants, fixed when it starts (the zero value: no deadline).
type times struct {
	// end is when the loop must have answered: its context's deadline, less the partial
	// margin with Input.Partial.
	end time.Time
	// tools is when its tools and subagents must have ended: end less the reserve (end
	// when there is none). A child's deadline is never later.
	tools time.Time
	// reserve says whether the loop keeps one.
	reserve bool
}

// loopTimes reads a loop's instants from ctx's deadline at now.
func loopTimes(ctx context.Context, r plan.Reserve, partial bool, margin time.Duration, now time.Time) times {
	dl, ok := ctx.Deadline()
	if !ok {
		return times{}
	}
	t := times{end: dl}
	if partial {
		t.end = dl.Add(-margin)
	}
	t.tools = r.Deadline(t.end, now)
	t.reserve = t.tools.Before(t.end)
	return t
}

// toolTimeUp reports whether, at now, a round of tools that takes about round cannot end
// before the reserve: the loop then asks its model for its final answer.
func (t times) toolTimeUp(now time.Time, round time.Duration) bool {
	return t.reserve && t.tools.Sub(now) < round
}

// timeLeft is the time the model is told it has at now: until its tools must end.
func (t times) timeLeft(now time.Time) (time.Duration, bool) {
	if t.tools.IsZero() {
		return 0, false
	}
	return t.tools.Sub(now), true
}

// noteBuckets are the edges the time-left note rounds down to, longest first: coarse, so
// the note changes rarely, and never more than the time there is.
var noteBuckets = []time.Duration{time.Hour, 30 * time.Minute, 10 * time.Minute, 5 * time.Minute, 2 * time.Minute,
	time.Minute, 30 * time.Second, 10 * time.Second, 5 * time.Second, 2 * time.Second, time.Second}

// bucket says d as the coarse range it falls in: "30s to 1m0s", "over 1h0m0s", "under 1s".
func bucket(d time.Duration) string {
	for i, b := range noteBuckets {
		if d >= b {
			if i == 0 {
				return "over " + b.String()
			}
			return b.String() + " to " + noteBuckets[i-1].String()
		}
	}
	return "under 1s"
}

// Texts of the notes the loop appends after the conversation (GenerateRequest.notes).
const (
	noteTimeLeft = "[curfew] Time left for this task, tools included: %s. Plan your tool calls to fit, and answer before it runs out."
	noteFinal    = "[curfew] The time for tools is up: answer now, with what you have. No tool can be called any more."
)

// timeNote is the note of the time left at now, or of the final answer; nil when the loop
// has no deadline and is not at its final answer.
func (t times) timeNote(now time.Time, final bool) []*modelproxyv1.Message {
	text := noteFinal
	if !final {
		left, ok := t.timeLeft(now)
		if !ok {
			return nil
		}
		text = fmt.Sprintf(noteTimeLeft, bucket(left))
	}
	return []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_SYSTEM, Content: text}}
}

// reserveResult is the result a tool call gets when the loop's reserve stopped it, or
// left it no time to start: the model learns why it has no result, and is then asked for
// its final answer.
func reserveResult(name string, started bool) string {
	why := "not run: the time for tools was up before it could start"
	if started {
		why = "stopped: the time for tools ran out before it ended"
	}
	b, _ := json.Marshal(map[string]string{"error": fmt.Sprintf("tool %s %s; answer with what you have", name, why)})
	return string(b)
}

// have is what a loop has gathered, for a partial answer: its model's text, and its
// latest tools' results.
type have struct {
	text  []string // each model step's text, the interrupted one's so far included
	tools []string // the latest round's results, "name: output"
}

func (h *have) addText(s string) {
	if s = strings.TrimSpace(s); s != "" {
		h.text = append(h.text, s)
	}
}

func (h *have) setTools(calls []*modelproxyv1.ToolCall, outs []string) {
	h.tools = h.tools[:0]
	for j, c := range calls {
		if j < len(outs) && outs[j] != "" {
			h.tools = append(h.tools, c.GetName()+": "+outs[j])
		}
	}
}

// answer is the partial answer: the model's text so far, or, when it said nothing, the
// results its latest tools returned.
func (h *have) answer() string {
	if len(h.text) > 0 {
		return strings.Join(h.text, "\n\n")
	}
	return strings.Join(h.tools, "\n")
}
