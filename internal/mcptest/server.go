package mcptest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// The curfew keys of a request's _meta, as curfew's tool sources send them (see
// services/toolrunner/internal/source; repeated here so this module does not import the
// toolrunner's).
const (
	metaPrefix         = "curfew.dev/"
	metaDeadline       = metaPrefix + "deadline"
	metaTimeoutMS      = metaPrefix + "timeout_ms"
	metaRunID          = metaPrefix + "run_id"
	metaNodeID         = metaPrefix + "node_id"
	metaRetryID        = metaPrefix + "retry_id"
	metaIdempotencyKey = metaPrefix + "idempotency_key"
)

// Meta is the curfew part of a call's _meta as the server received it.
type Meta struct {
	// Deadline is the absolute deadline in Unix milliseconds; 0 when absent.
	Deadline int64 `json:"deadline,omitempty"`
	// TimeoutMS is the time left when the call was sent; -1 when absent.
	TimeoutMS      int64  `json:"timeout_ms"`
	RunID          string `json:"run_id,omitempty"`
	NodeID         string `json:"node_id,omitempty"`
	RetryID        string `json:"retry_id,omitempty"`
	IdempotencyKey string `json:"idempotency_key,omitempty"`
	// Keys lists every curfew key present, sorted.
	Keys []string `json:"keys,omitempty"`
}

// Record is one call as the server saw it.
type Record struct {
	Tool string `json:"tool"`
	Meta Meta   `json:"meta"`
	// MetaError says why the _meta was malformed; empty when it was well-formed.
	MetaError string `json:"meta_error,omitempty"`
	// StartedNS is when the handler started; CtxDoneNS when its context ended while it
	// ran (0 if it did not); ReturnedNS when it returned. Unix nanoseconds.
	StartedNS  int64 `json:"started_ns"`
	CtxDoneNS  int64 `json:"ctx_done_ns,omitempty"`
	ReturnedNS int64 `json:"returned_ns"`
	// Progress is how many progress notifications the call sent.
	Progress int `json:"progress,omitempty"`
}

// Recorder appends Records as JSON lines to a writer. Its methods are safe for
// concurrent use.
type Recorder struct {
	mu sync.Mutex
	w  io.Writer
}

// NewRecorder returns a Recorder writing to w.
func NewRecorder(w io.Writer) *Recorder { return &Recorder{w: w} }

func (r *Recorder) write(rec Record) {
	if r == nil {
		return
	}
	line, err := json.Marshal(rec)
	if err != nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	_, _ = r.w.Write(append(line, '\n'))
}

// ReadRecords reads the records of a --record file; a missing file has none.
func ReadRecords(path string) ([]Record, error) {
	f, err := os.Open(path) //nolint:gosec // the test names its own record file
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []Record
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 16*1024*1024)
	for sc.Scan() {
		var rec Record
		if err := json.Unmarshal(sc.Bytes(), &rec); err != nil {
			return out, fmt.Errorf("mcptest: record %d: %w", len(out)+1, err)
		}
		out = append(out, rec)
	}
	return out, sc.Err()
}

// NewServer returns the test server with its tools; rec may be nil.
func NewServer(rec *Recorder) *mcp.Server {
	s := mcp.NewServer(&mcp.Implementation{Name: "curfew-mcptest", Version: "1"}, nil)
	t := &tools{rec: rec, effects: map[string]int{}}
	// Annotations: drop says destructiveHint true explicitly (toolrunner gates it behind
	// a human's approval); echo has annotations that leave destructiveHint out (the
	// protocol's default, true, must not count as said); the others have none.
	destructive := true
	annotations := map[string]*mcp.ToolAnnotations{"drop": {DestructiveHint: &destructive}, "echo": {Title: "Echo"}}
	add := func(name, desc string, props map[string]any, h func(context.Context, *call) (*mcp.CallToolResult, error)) {
		schema := map[string]any{"type": "object", "properties": props}
		s.AddTool(&mcp.Tool{Name: name, Description: desc, InputSchema: schema, Annotations: annotations[name]}, t.handler(name, h))
	}
	num := map[string]any{"type": "integer", "minimum": 0}
	add("echo", "Returns its text.", map[string]any{"text": map[string]any{"type": "string"}}, t.echo)
	add("wait", "Waits ms milliseconds or until cancelled, with progress every progress_ms.",
		map[string]any{"ms": num, "progress_ms": num}, t.wait)
	add("stubborn", "Ignores cancellation: progress every progress_ms for ms milliseconds.",
		map[string]any{"ms": num, "progress_ms": num}, t.stubborn)
	add("effect", "Does its effect once per idempotency key; returns the key's counts.", map[string]any{}, t.effect)
	add("big", "Returns bytes bytes of text.", map[string]any{"bytes": num}, t.big)
	add("drop", "Says it dropped its text; annotated destructiveHint true.", map[string]any{"text": map[string]any{"type": "string"}},
		func(_ context.Context, c *call) (*mcp.CallToolResult, error) {
			return textResult("dropped " + c.args.Text), nil
		})
	add("add_tool", "Adds a tool named name that echoes like echo; the server then says its list changed.",
		map[string]any{"name": map[string]any{"type": "string"}}, func(_ context.Context, c *call) (*mcp.CallToolResult, error) {
			if c.args.Name == "" {
				return errorResult("add_tool needs a name"), nil
			}
			add(c.args.Name, "Added by add_tool; returns its text.", map[string]any{"text": map[string]any{"type": "string"}}, t.echo)
			return textResult("added " + c.args.Name), nil
		})
	return s
}

type tools struct {
	rec     *Recorder
	mu      sync.Mutex
	effects map[string]int // calls seen per idempotency key
}

// call is one tool call in progress.
type call struct {
	req  *mcp.CallToolRequest
	args struct {
		Text       string `json:"text"`
		MS         int64  `json:"ms"`
		ProgressMS int64  `json:"progress_ms"`
		Bytes      int    `json:"bytes"`
		Name       string `json:"name"`
	}
	meta     Meta
	progress int
}

func (t *tools) handler(name string, h func(context.Context, *call) (*mcp.CallToolResult, error)) mcp.ToolHandler {
	return func(ctx context.Context, req *mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		rec := Record{Tool: name, StartedNS: time.Now().UnixNano()}
		var ctxDone sync.Once
		var ctxDoneNS int64
		markDone := func() { ctxDone.Do(func() { ctxDoneNS = time.Now().UnixNano() }) }
		stop := context.AfterFunc(ctx, markDone)
		defer func() {
			// The AfterFunc ran or is running (wait for its time); or ctx is done and
			// the AfterFunc was stopped before it could start: ctx's Done closes before
			// its AfterFuncs are started, so the handler can see it first.
			if !stop() || ctx.Err() != nil {
				markDone()
			}
			rec.CtxDoneNS = ctxDoneNS
			rec.ReturnedNS = time.Now().UnixNano()
			t.rec.write(rec)
		}()
		c := &call{req: req}
		meta, err := parseMeta(req.Params.Meta)
		rec.Meta = meta
		c.meta = meta
		if err != nil {
			rec.MetaError = err.Error()
			return errorResult("malformed _meta: " + err.Error()), nil
		}
		if len(req.Params.Arguments) > 0 {
			if err := json.Unmarshal(req.Params.Arguments, &c.args); err != nil {
				return errorResult("bad arguments: " + err.Error()), nil
			}
		}
		res, err := h(ctx, c)
		rec.Progress = c.progress
		return res, err
	}
}

// parseMeta reads curfew's keys from a request's _meta and says what is malformed.
func parseMeta(m mcp.Meta) (Meta, error) {
	out := Meta{TimeoutMS: -1}
	var problems []string
	integer := func(key string) (int64, bool) {
		v, ok := m[key]
		if !ok {
			return 0, false
		}
		f, isNum := v.(float64)
		if !isNum || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
			problems = append(problems, fmt.Sprintf("%s is %v, not an integer", key, v))
			return 0, false
		}
		return int64(f), true
	}
	str := func(key string, required bool) string {
		v, ok := m[key]
		if !ok {
			if required {
				problems = append(problems, key+" is missing")
			}
			return ""
		}
		s, isStr := v.(string)
		if !isStr {
			problems = append(problems, fmt.Sprintf("%s is %v, not a string", key, v))
		}
		return s
	}
	for k := range m {
		if strings.HasPrefix(k, metaPrefix) {
			out.Keys = append(out.Keys, k)
		}
	}
	if len(out.Keys) == 0 {
		return out, nil // a client that is not curfew
	}
	slices.Sort(out.Keys)
	if d, ok := integer(metaDeadline); ok {
		out.Deadline = d
		if d <= 0 {
			problems = append(problems, fmt.Sprintf("%s is %d, not a time", metaDeadline, d))
		}
	}
	if ms, ok := integer(metaTimeoutMS); ok {
		out.TimeoutMS = ms
		if ms < 0 {
			problems = append(problems, fmt.Sprintf("%s is negative (%d)", metaTimeoutMS, ms))
		}
	}
	if (out.Deadline == 0) != (out.TimeoutMS < 0) {
		problems = append(problems, metaDeadline+" and "+metaTimeoutMS+" come together")
	}
	out.RunID = str(metaRunID, true)
	out.NodeID = str(metaNodeID, true)
	out.RetryID = str(metaRetryID, true)
	out.IdempotencyKey = str(metaIdempotencyKey, false)
	if _, ok := m[metaIdempotencyKey]; ok && out.IdempotencyKey == "" {
		problems = append(problems, metaIdempotencyKey+" is empty")
	}
	if len(problems) > 0 {
		return out, fmt.Errorf("%s", strings.Join(problems, "; "))
	}
	return out, nil
}

func errorResult(text string) *mcp.CallToolResult {
	return &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: text}}}
}

func textResult(text string) *mcp.CallToolResult {
	return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: text}}}
}

func (t *tools) echo(_ context.Context, c *call) (*mcp.CallToolResult, error) {
	return textResult(c.args.Text), nil
}

// notify sends one progress report for c, if its caller asked for them. ctx may be
// cancelled already for a stubborn tool, so the report is sent on a context of its own.
func (c *call) notify(ctx context.Context, total float64) {
	token := c.req.Params.GetProgressToken()
	if token == nil {
		return
	}
	c.progress++
	nctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_ = c.req.Session.NotifyProgress(nctx, &mcp.ProgressNotificationParams{
		ProgressToken: token,
		Progress:      float64(c.progress),
		Total:         total,
		Message:       fmt.Sprintf("report %d", c.progress),
	})
}

// run ticks progress every c.args.ProgressMS for c.args.MS, or until stop ends.
func (c *call) run(ctx context.Context, stop <-chan struct{}) bool {
	end := time.NewTimer(time.Duration(c.args.MS) * time.Millisecond)
	defer end.Stop()
	var tick <-chan time.Time
	total := 0.0
	if c.args.ProgressMS > 0 {
		tk := time.NewTicker(time.Duration(c.args.ProgressMS) * time.Millisecond)
		defer tk.Stop()
		tick = tk.C
		total = float64(c.args.MS / c.args.ProgressMS)
	}
	for {
		select {
		case <-end.C:
			return true
		case <-stop:
			return false
		case <-tick:
			c.notify(ctx, total)
		}
	}
}

func (t *tools) wait(ctx context.Context, c *call) (*mcp.CallToolResult, error) {
	if !c.run(ctx, ctx.Done()) {
		return nil, ctx.Err()
	}
	return textResult(fmt.Sprintf("waited %d ms", c.args.MS)), nil
}

func (t *tools) stubborn(ctx context.Context, c *call) (*mcp.CallToolResult, error) {
	c.run(ctx, nil)
	return textResult(fmt.Sprintf("ignored cancellation for %d ms", c.args.MS)), nil
}

func (t *tools) effect(_ context.Context, c *call) (*mcp.CallToolResult, error) {
	key := c.meta.IdempotencyKey
	if key == "" {
		return errorResult("effect needs " + metaIdempotencyKey + " in _meta"), nil
	}
	t.mu.Lock()
	t.effects[key]++
	calls := t.effects[key]
	t.mu.Unlock()
	out := map[string]any{"key": key, "calls": calls, "effects": 1}
	return &mcp.CallToolResult{
		StructuredContent: out,
		Content:           []mcp.Content{&mcp.TextContent{Text: fmt.Sprintf("key %s: %d calls, 1 effect", key, calls)}},
	}, nil
}

func (t *tools) big(_ context.Context, c *call) (*mcp.CallToolResult, error) {
	return textResult(strings.Repeat("x", c.args.Bytes)), nil
}
