package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/term"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
)

func cmdRun(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlags("run", stderr)
	var c common
	c.register(fs)
	planFile := fs.String("plan", "", "file holding a JSON plan (see docs/plan.md); - reads standard input")
	dl := fs.Duration("deadline", 30*time.Second, "the run's deadline, from now")
	model := fs.String("model", "", "model (default: the orchestrator's, sim)")
	cont := fs.Bool("continue", false, "keep the run going if this command goes away")
	cancelAfter := fs.Duration("cancel-after", 0, "disconnect after this long, as a Ctrl-C would (for demos and drills)")
	system := fs.String("system", "", "the run's system prompt")
	maxTokens := fs.Int("max-tokens", 0, "bound on each model step's output tokens (default: the provider's)")
	temperature := fs.Float64("temperature", 0, "sampling temperature, 0 to 2 (default: the provider's)")
	maxSteps := fs.Int("max-steps", 0, "the most model steps (default: the orchestrator's limit, 64)")
	tools := fs.String("tools", "", "comma-separated names of the tools the run may use (default: every tool the tenant may use)")
	failOnToolError := fs.Bool("fail-on-tool-error", false, "a failed tool call fails the run, instead of going back to the model as its result")
	events := fs.String("events", "all", "what the run's stream shows between its start and its summary: all (node updates and the text as it streams), nodes (node updates only) or summary (nothing)")
	reserve := fs.String("reserve", "", `time the run keeps for its final answer: a duration ("2s") or a fraction of the deadline ("0.2"); its tools and subagents stop that long before the deadline (docs/reserve.md)`)
	pos, err := parse(fs, args)
	if err != nil {
		return usageErr(stderr, "run", err)
	}
	var task string
	switch {
	case *planFile != "" && len(pos) > 0:
		return usageErr(stderr, "run", errors.New("give either --plan FILE or a TASK, not both"))
	case *planFile == "-":
		b, err := io.ReadAll(os.Stdin)
		if err != nil {
			return usageErr(stderr, "run", err)
		}
		task = string(b)
	case *planFile != "":
		b, err := os.ReadFile(*planFile)
		if err != nil {
			return usageErr(stderr, "run", fmt.Errorf("--plan: %w", err))
		}
		task = string(b)
	case len(pos) == 1:
		task = pos[0]
	case len(pos) > 1:
		return usageErr(stderr, "run", errors.New("give the task as one argument (quote it)"))
	default:
		return usageErr(stderr, "run", errors.New("give --plan FILE or a TASK"))
	}
	if *dl <= 0 {
		return usageErr(stderr, "run", errors.New("--deadline must be positive"))
	}
	runEvents, ok := map[string]orchestratorv1.RunEvents{"all": orchestratorv1.RunEvents_RUN_EVENTS_ALL,
		"nodes": orchestratorv1.RunEvents_RUN_EVENTS_NODES, "summary": orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY}[*events]
	if !ok {
		return usageErr(stderr, "run", fmt.Errorf("--events: %q is not all, nodes or summary", *events))
	}
	conn, err := c.dial()
	if err != nil {
		return callErr(stderr, "dial", err)
	}
	defer conn.Close()
	client := orchestratorv1.NewOrchestratorServiceClient(conn)

	// Ctrl-C (or --cancel-after) cancels the call: the orchestrator sees the disconnect
	// and cancels the run's tree, unless --continue.
	base := context.WithoutCancel(ctx)
	callCtx, cancelCall := context.WithTimeout(ctx, *dl)
	defer cancelCall()
	sigCtx, stopSig := signal.NotifyContext(callCtx, os.Interrupt, syscall.SIGTERM)
	defer stopSig()
	interrupted := make(chan struct{})
	go func() {
		var after <-chan time.Time
		if *cancelAfter > 0 {
			t := time.NewTimer(*cancelAfter)
			defer t.Stop()
			after = t.C
		}
		select {
		case <-sigCtx.Done():
			if callCtx.Err() != nil {
				return // the deadline, or the call ended
			}
		case <-after:
		}
		close(interrupted)
		cancelCall()
	}()

	v := newView(stdout, c.json)
	req := &orchestratorv1.RunRequest{Task: task, Model: *model, ContinueOnDisconnect: *cont, Reserve: *reserve, Events: runEvents,
		MaxTokens: int32(min(max(*maxTokens, -1), math.MaxInt32)), MaxSteps: int32(min(max(*maxSteps, -1), math.MaxInt32))} //nolint:gosec // clamped
	if *system != "" {
		req.Messages = []*orchestratorv1.Message{{Role: orchestratorv1.MessageRole_MESSAGE_ROLE_SYSTEM, Content: *system}}
	}
	fs.Visit(func(f *flag.Flag) { // unset is the provider's default, not 0
		if f.Name == "temperature" {
			req.Temperature = temperature
		}
	})
	for t := range strings.SplitSeq(*tools, ",") {
		if t = strings.TrimSpace(t); t != "" {
			req.Tools = append(req.Tools, t)
		}
	}
	if *failOnToolError {
		req.ToolErrors = orchestratorv1.ToolErrors_TOOL_ERRORS_FAIL_RUN
	}
	stream, err := client.Run(sigCtx, req)
	if err != nil {
		return callErr(stderr, "run", err)
	}
	var runID string
	for {
		ev, err := stream.Recv()
		if err == nil {
			switch e := ev.GetEvent().(type) {
			case *orchestratorv1.RunResponse_Started:
				runID = e.Started.GetRunId()
				v.started(ev, e.Started)
			case *orchestratorv1.RunResponse_Node:
				v.node(ev, e.Node)
			case *orchestratorv1.RunResponse_NodeEvent:
				v.event(ev, e.NodeEvent)
			case *orchestratorv1.RunResponse_Finished:
				v.finished(ev, e.Finished)
				return exitFor(e.Finished)
			}
			continue
		}
		if errors.Is(err, io.EOF) {
			v.stop()
			fmt.Fprintln(stderr, "curfew run: the stream ended without a summary")
			return ExitFail
		}
		cancelled := false
		select {
		case <-interrupted:
			cancelled = true
		default:
		}
		if runID == "" || (!cancelled && status.Code(err) != codes.DeadlineExceeded && status.Code(err) != codes.Canceled) {
			v.stop()
			return callErr(stderr, "run", err)
		}
		// The call is over (cancelled here, or the deadline passed on our side first); the
		// run's summary comes from the orchestrator once its tree has been torn down.
		run, gerr := awaitSummary(base, client, runID)
		if gerr != nil {
			v.stop()
			return callErr(stderr, "get run "+runID, gerr)
		}
		v.finished(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Finished{Finished: run}}, run)
		return exitFor(run)
	}
}

func exitFor(r *orchestratorv1.Run) int {
	if r.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		return ExitOK
	}
	return ExitFail
}

// awaitSummary polls GetRun until the run has ended.
func awaitSummary(ctx context.Context, client orchestratorv1.OrchestratorServiceClient, id string) (*orchestratorv1.Run, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		resp, err := client.GetRun(ctx, &orchestratorv1.GetRunRequest{RunId: id})
		if err != nil {
			return nil, err
		}
		if resp.GetRun().GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return resp.GetRun(), nil
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// view renders a run: JSON lines, a live tree on a terminal, or plain text.
type view struct {
	w        io.Writer
	json     bool
	live     bool
	mu       sync.Mutex
	runID    string
	deadline time.Time
	nodes    map[string]*meshv1.Node
	// progress is the latest progress of each running node, for the live tree.
	progress map[string]*meshv1.Progress
	// answer is the text of the root's latest model node as it streams (the answer, once
	// the root's last step runs): see text.
	answer   answerText
	width    int // the terminal's columns, for the live tree's text lines
	lines    int
	stopTick chan struct{}
	wg       sync.WaitGroup
}

func newView(w io.Writer, asJSON bool) *view {
	v := &view{w: w, json: asJSON, nodes: map[string]*meshv1.Node{}, progress: map[string]*meshv1.Progress{}}
	if f, ok := w.(*os.File); ok && !asJSON && term.IsTerminal(int(f.Fd())) {
		v.live = true
		v.width = 80
		if w, _, err := term.GetSize(int(f.Fd())); err == nil && w > 0 {
			v.width = w
		}
	}
	return v
}

func (v *view) started(ev *orchestratorv1.RunResponse, s *orchestratorv1.RunStarted) {
	v.mu.Lock()
	v.runID, v.deadline = s.GetRunId(), s.GetDeadline().AsTime()
	v.mu.Unlock()
	switch {
	case v.json:
		printJSON(v.w, ev)
	case v.live:
		v.stopTick = make(chan struct{})
		v.wg.Add(1)
		go func() {
			defer v.wg.Done()
			t := time.NewTicker(100 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-v.stopTick:
					return
				case <-t.C:
					v.redraw()
				}
			}
		}()
	default:
		fmt.Fprintf(v.w, "run %s started, deadline %s\n", s.GetRunId(), v.deadline.Local().Format("15:04:05.000"))
	}
}

func (v *view) node(ev *orchestratorv1.RunResponse, n *meshv1.Node) {
	if v.json {
		printJSON(v.w, ev)
		return
	}
	v.mu.Lock()
	v.nodes[n.GetId()] = proto.Clone(n).(*meshv1.Node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING {
		delete(v.progress, n.GetId())
		if !v.live && v.answer.node == n.GetId() && v.answer.open {
			fmt.Fprintln(v.w) // the node's streamed text ends its line
			v.answer.open = false
		}
	}
	v.mu.Unlock()
}

// event shows a node event: every one as a JSON line; on the live tree, a running
// node's latest progress; the text of the root's model nodes (see text). Kinds this view
// does not know are skipped.
func (v *view) event(ev *orchestratorv1.RunResponse, e *meshv1.NodeEvent) {
	if v.json {
		printJSON(v.w, ev)
		return
	}
	if d := e.GetText(); d != nil {
		v.text(e.GetNodeId(), d)
		return
	}
	if p := e.GetProgress(); p != nil {
		v.mu.Lock()
		if n := v.nodes[e.GetNodeId()]; n == nil || n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
			v.progress[e.GetNodeId()] = p
		}
		v.mu.Unlock()
	}
}

// text shows a delta of a root model node's text (root/m<i>: the root's own steps, the
// last of which is the answer; a subagent's text is not shown). On the live tree the
// latest of these nodes' text is painted under the tree, its last maxTextLines lines. On
// plain output (not a terminal) the text is written as it arrives, after a "root/m1: "
// label, and its line ends with its node: nothing is repainted.
func (v *view) text(id string, d *meshv1.TextDelta) {
	if !agent.IsModelStepOf("root", id) {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if n := v.nodes[id]; n != nil && n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING {
		return
	}
	a := &v.answer
	if a.node != id {
		if !v.live && a.open {
			fmt.Fprintln(v.w)
		}
		*a = answerText{node: id}
	}
	add := a.add(d)
	if v.live || add == "" {
		return
	}
	if !a.open {
		fmt.Fprintf(v.w, "%s: ", id)
		a.open = true
	}
	fmt.Fprint(v.w, printable(add, true))
}

// maxText bounds the text the view keeps of a node (its latest part); maxTextLines the
// lines of it the live tree shows.
const (
	maxText      = 16 << 10
	maxTextLines = 8
)

// answerText is the text of one model node as its deltas came, its latest maxText bytes.
type answerText struct {
	node string
	text string
	have int64 // bytes of the node's text seen: where the next delta follows
	open bool  // plain output: the node's label is written and its line not ended
}

// add adds delta d and returns what it added: the part of it not seen before, after
// "…" when deltas between were lost (a slow read, or a watcher that joined late).
func (a *answerText) add(d *meshv1.TextDelta) string {
	off, t := d.GetOffset(), d.GetText()
	end := off + int64(len(t))
	if end <= a.have {
		return ""
	}
	switch {
	case off < a.have:
		t = t[a.have-off:]
	case off > a.have:
		t = "…" + t
	}
	a.have = end
	a.text += t
	if cut := len(a.text) - maxText; cut > 0 {
		for cut < len(a.text) && !utf8.RuneStart(a.text[cut]) {
			cut++
		}
		a.text = a.text[cut:]
	}
	return t
}

// textLines is text as the live tree paints it: its last max lines, each cut into lines
// of at most width characters so that none wraps (the repaint counts lines), without
// control characters.
func textLines(text string, width, max int) []string {
	if width < 2 {
		width = 2
	}
	var out []string
	for _, l := range strings.Split(printable(text, true), "\n") {
		r := []rune(l)
		for len(r) > width-1 {
			out = append(out, string(r[:width-1]))
			r = r[width-1:]
		}
		out = append(out, string(r))
	}
	if len(out) > max {
		out = out[len(out)-max:]
	}
	return out
}

// printable is s without control characters (it is a model's or a tool's text, written
// to a terminal): each becomes a space, but a newline when keepNewlines.
func printable(s string, keepNewlines bool) string {
	return strings.Map(func(r rune) rune {
		if r == '\n' && keepNewlines {
			return r
		}
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
}

func (v *view) stop() {
	if v.stopTick != nil {
		close(v.stopTick)
		v.wg.Wait()
		v.stopTick = nil
	}
}

func (v *view) finished(ev *orchestratorv1.RunResponse, r *orchestratorv1.Run) {
	v.stop()
	if v.json {
		printJSON(v.w, ev)
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	v.clear()
	if !v.live && v.answer.open {
		fmt.Fprintln(v.w)
		v.answer.open = false
	}
	printSummary(v.w, r)
}

// redraw paints the live tree: deadline countdown and tokens per node.
func (v *view) redraw() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.clear()
	var b strings.Builder
	left := time.Until(v.deadline).Round(100 * time.Millisecond)
	if left < 0 {
		left = 0
	}
	var total int64
	ns := make([]*meshv1.Node, 0, len(v.nodes))
	for _, n := range v.nodes {
		ns = append(ns, n)
		total += n.GetTokens()
	}
	sort.Slice(ns, func(i, j int) bool { return ns[i].GetId() < ns[j].GetId() })
	fmt.Fprintf(&b, "run %s   deadline in %-6s   tokens %d   (Ctrl-C cancels)\n", v.runID, left, total)
	for _, n := range ns {
		fmt.Fprintf(&b, "%s\n", nodeLine(n, v.progress[n.GetId()]))
	}
	if a := v.answer; a.text != "" {
		fmt.Fprintf(&b, "%s:\n", a.node)
		for _, l := range textLines(a.text, v.width-2, maxTextLines) { // indented by two
			fmt.Fprintf(&b, "  %s\n", l)
		}
	}
	v.lines = strings.Count(b.String(), "\n")
	fmt.Fprint(v.w, b.String())
}

func (v *view) clear() {
	if v.live && v.lines > 0 {
		fmt.Fprintf(v.w, "\x1b[%dA\x1b[J", v.lines)
		v.lines = 0
	}
}

// nodeLine is a node's line of the live tree, with its latest progress p (nil: none).
func nodeLine(n *meshv1.Node, p *meshv1.Progress) string {
	depth := strings.Count(n.GetId(), "/")
	name := n.GetId()[strings.LastIndexByte(n.GetId(), '/')+1:]
	tok := ""
	if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL {
		tok = fmt.Sprintf("%d tok", n.GetTokens())
	}
	if p != nil {
		tok = strings.TrimSpace(tok + " " + progressText(p))
	}
	return fmt.Sprintf("%s%-*s %-9s %-15s %-10s %s", strings.Repeat("  ", depth), 14-2*min(depth, 6), name,
		lower(n.GetKind().String(), "NODE_KIND_"), n.GetName(), lower(n.GetStatus().String(), "NODE_STATUS_"), tok)
}

// progressText is a progress report as the live tree shows it: "42% 4200/10000" when
// its total is known, else "4200"; then its message, on one line, without control
// characters (it is the tool's text, painted on the terminal), and cut at
// maxProgressMessage characters.
func progressText(p *meshv1.Progress) string {
	s := strconv.FormatFloat(p.GetProgress(), 'f', -1, 64)
	if t := p.GetTotal(); t > 0 {
		s = fmt.Sprintf("%.0f%% %s/%s", math.Floor(100*p.GetProgress()/t), s, strconv.FormatFloat(t, 'f', -1, 64))
	}
	m := printable(p.GetMessage(), false)
	if r := []rune(m); len(r) > maxProgressMessage {
		m = string(r[:maxProgressMessage-1]) + "…"
	}
	if m = strings.TrimSpace(m); m != "" {
		s += " " + m
	}
	return s
}

// maxProgressMessage bounds the progress message shown on a node's line.
const maxProgressMessage = 60

func printSummary(w io.Writer, r *orchestratorv1.Run) {
	fmt.Fprintf(w, "run %s  %s", r.GetRunId(), lower(r.GetStatus().String(), "RUN_STATUS_"))
	if c := r.GetCause(); c != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		fmt.Fprintf(w, " (cause %s)", lower(c.String(), "CANCEL_CAUSE_"))
	}
	if r.GetErrorCode() != "" {
		fmt.Fprintf(w, "  %s: %s", r.GetErrorCode(), r.GetErrorMessage())
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "deadline %s", r.GetDeadline().AsTime().Local().Format("15:04:05.000"))
	if r.GetCancelledAt() != nil {
		fmt.Fprintf(w, "   cancelled at %s", r.GetCancelledAt().AsTime().Local().Format("15:04:05.000"))
	}
	fmt.Fprintf(w, "   tokens %d   tokens after cancel %d   prompt tokens %d\n", r.GetTokens(), r.GetTokensAfterCancel(), r.GetPromptTokens())
	if len(r.GetNodes()) > 0 {
		fmt.Fprintf(w, "%-34s %-9s %-17s %-18s %7s %9s %8s %9s\n", "NODE", "KIND", "STATUS", "CAUSE", "TOKENS", "AT_CANCEL", "AFTER", "RAN")
	}
	for _, n := range r.GetNodes() {
		ran := ""
		if n.GetStartedAt() != nil && n.GetEndedAt() != nil {
			ran = n.GetEndedAt().AsTime().Sub(n.GetStartedAt().AsTime()).Round(time.Millisecond).String()
		}
		fmt.Fprintf(w, "%-34s %-9s %-17s %-18s %7d %9d %8d %9s\n", n.GetId(), lower(n.GetKind().String(), "NODE_KIND_"),
			lower(n.GetStatus().String(), "NODE_STATUS_"), causeName(n.GetCause()),
			n.GetTokens(), n.GetTokensAtCancel(), n.GetTokensAfterCancel(), ran)
		if cl := n.GetCleanup(); cl != nil {
			state := "completed"
			if !cl.GetCompleted() {
				state = "FAILED: " + cl.GetError()
			}
			fmt.Fprintf(w, "%-34s cleanup %q %s in %v (budget %v)\n", "", cl.GetAction(), state,
				cl.GetEndedAt().AsTime().Sub(cl.GetStartedAt().AsTime()).Round(time.Millisecond), cl.GetBudget().AsDuration())
		}
	}
	if r.GetAnswer() != "" {
		fmt.Fprintf(w, "answer: %s\n", strings.TrimSpace(r.GetAnswer()))
	}
}

func causeName(c meshv1.CancelCause) string {
	if c == meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		return "-"
	}
	return lower(c.String(), "CANCEL_CAUSE_")
}
