package registry

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fake is a Source in memory: its list, whether listing fails, and what a call does.
type fake struct {
	mu      sync.Mutex
	tools   []source.Tool
	listErr error
	lists   int
	changed chan struct{}
	call    func(ctx context.Context, c source.Call) (source.Result, error)
	calls   []source.Call
	closed  bool
}

func (f *fake) List(context.Context) ([]source.Tool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.lists++
	if f.listErr != nil {
		return nil, f.listErr
	}
	return append([]source.Tool(nil), f.tools...), nil
}

func (f *fake) Call(ctx context.Context, c source.Call, _ func(*meshv1.Progress)) (source.Result, error) {
	f.mu.Lock()
	f.calls = append(f.calls, c)
	call := f.call
	f.mu.Unlock()
	if call == nil {
		return source.Result{Output: json.RawMessage(`{"ok":true}`)}, nil
	}
	return call(ctx, c)
}

func (f *fake) Changed() <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed
}

func (f *fake) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	return nil
}

func (f *fake) set(fn func(f *fake)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

func (f *fake) attempts() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.calls)
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// open returns a registry of the sources in file (JSON), each opened as the fake of the
// same name.
func open(t *testing.T, file string, fakes map[string]*fake, reg prometheus.Registerer, logs io.Writer) *Registry {
	t.Helper()
	cfg, err := Parse([]byte(file), lookupEnv, lookPath)
	if err != nil {
		t.Fatal(err)
	}
	opener := func(_ context.Context, sc SourceConfig, _ Hooks) (source.Source, error) {
		f := fakes[sc.Name]
		if f == nil {
			return nil, errors.New("connection refused")
		}
		return f, nil
	}
	if logs == nil {
		logs = io.Discard
	}
	r, err := New(cfg, Options{Openers: map[string]Opener{KindGRPC: opener, KindMCPStdio: opener, KindMCPHTTP: opener},
		Registerer: reg, Logger: slog.New(slog.NewTextHandler(logs, nil)),
		Breaker: breaker.Config{OpenTimeout: 20 * time.Millisecond, Jitter: -1},
		Relist:  retry.Policy{Base: 5 * time.Millisecond, Cap: 20 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	return r
}

// eventually polls cond until it holds or 5s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}

func names(r *Registry, tenant string) []string {
	var out []string
	for _, tl := range r.Tools(tenant) {
		if tl.Source != BuiltinSource {
			out = append(out, tl.Name)
		}
	}
	return out
}

func grpcSource(name, extra string) string {
	return `{"name": "` + name + `", "kind": "grpc", "address": "127.0.0.1:1"` + extra + `}`
}

func TestName(t *testing.T) {
	long := strings.Repeat("x", 70)
	for _, tc := range []struct{ source, tool, want string }{
		{"github", "search", "github__search"},
		{"fs", "read.file", "fs__read_file"},
		{"fs", "lire/fichier é", "fs__lire_fichier__"},
		{"a", long, "a__" + long[:64-9-3] + "_"}, // then 8 hex digits
	} {
		got := Name(tc.source, tc.tool)
		if !ValidName(got) || !strings.HasPrefix(got, tc.want) || len(got) > MaxNameLen {
			t.Errorf("Name(%q, %q) = %q, want %q…, valid, at most %d", tc.source, tc.tool, got, tc.want, MaxNameLen)
		}
		if SourceOf(got) != tc.source {
			t.Errorf("SourceOf(%q) = %q", got, SourceOf(got))
		}
	}
	a, b := Name("a", long+"1"), Name("a", long+"2")
	if a == b || len(a) != MaxNameLen || a[:55] != b[:55] {
		t.Errorf("long names that differ only past the cut: %q and %q", a, b)
	}
	if Name("a", long+"1") != a {
		t.Error("Name is not stable")
	}
}

func TestEffects(t *testing.T) {
	yes, no := true, false
	irr, none := catalog.Irreversible, catalog.None
	for _, tc := range []struct {
		name       string
		configured *catalog.SideEffects
		trusted    bool
		hints      source.Hints
		want       catalog.SideEffects
	}{
		{"untrusted, no hints", nil, false, source.Hints{}, catalog.Irreversible},
		{"untrusted, read-only", nil, false, source.Hints{ReadOnly: &yes}, catalog.Irreversible},
		{"untrusted, idempotent", nil, false, source.Hints{Idempotent: &yes}, catalog.Irreversible},
		{"untrusted, not destructive", nil, false, source.Hints{Destructive: &no}, catalog.Irreversible},
		{"trusted, no hints", nil, true, source.Hints{}, catalog.Irreversible},
		{"trusted, read-only", nil, true, source.Hints{ReadOnly: &yes}, catalog.None},
		{"trusted, read-only and destructive", nil, true, source.Hints{ReadOnly: &yes, Destructive: &yes}, catalog.None},
		{"trusted, idempotent", nil, true, source.Hints{Idempotent: &yes, Destructive: &yes}, catalog.Idempotent},
		{"trusted, not read-only", nil, true, source.Hints{ReadOnly: &no}, catalog.Irreversible},
		{"trusted, not destructive only", nil, true, source.Hints{Destructive: &no}, catalog.Irreversible},
		{"config none beats untrusted", &none, false, source.Hints{}, catalog.None},
		{"config irreversible beats trusted read-only", &irr, true, source.Hints{ReadOnly: &yes}, catalog.Irreversible},
	} {
		if got := Effects(tc.configured, tc.trusted, tc.hints); got != tc.want {
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// Only an explicit destructiveHint true gates a tool; the configuration wins.
func TestApproval(t *testing.T) {
	yes, no := true, false
	for _, tc := range []struct {
		name       string
		configured *bool
		hints      source.Hints
		want       string
	}{
		{"no hints", nil, source.Hints{}, ""},
		{"destructive absent, other hints", nil, source.Hints{ReadOnly: &no, Idempotent: &no}, ""},
		{"destructive false", nil, source.Hints{Destructive: &no}, ""},
		{"destructive true", nil, source.Hints{Destructive: &yes}, ApprovalDestructiveHint},
		{"config true", &yes, source.Hints{}, ApprovalRegistry},
		{"config false beats destructive", &no, source.Hints{Destructive: &yes}, ""},
	} {
		if got := Approval(tc.configured, tc.hints); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

// The tools file's approval, per source and per tool, and the hints reach the catalog
// entry and the prepared call.
func TestApprovalFromConfig(t *testing.T) {
	yes := true
	f := &fake{tools: []source.Tool{{Name: "drop", Hints: source.Hints{Destructive: &yes}}, {Name: "write"}, {Name: "read"}}}
	r := open(t, `{"sources": [`+grpcSource("s", `, "tools": {"write": {"approval": true}}`)+`,`+
		grpcSource("u", `, "approval": true, "tools": {"read": {"approval": false}}`)+`]}`, map[string]*fake{"s": f, "u": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 6 })
	want := map[string]string{"s__drop": ApprovalDestructiveHint, "s__write": ApprovalRegistry, "s__read": "",
		"u__drop": ApprovalRegistry, "u__write": ApprovalRegistry, "u__read": ""}
	for _, tl := range r.Tools("") {
		if w, ok := want[tl.Name]; ok && tl.Approval != w {
			t.Errorf("%s: approval %q, want %q", tl.Name, tl.Approval, w)
		}
	}
	p, err := r.Prepare("", "s__drop", nil)
	if err != nil || p.Approval() != ApprovalDestructiveHint || p.MinTime() != DefaultMinTime {
		t.Fatalf("prepared s__drop: %v, approval %q", err, p.Approval())
	}
}

// A tool's override beats its source's policy, which beats the hints.
func TestEffectsFromConfig(t *testing.T) {
	yes := true
	f := &fake{tools: []source.Tool{{Name: "read", Hints: source.Hints{ReadOnly: &yes}}, {Name: "write"}, {Name: "get"}}}
	r := open(t, `{"sources": [`+grpcSource("s", `, "trusted": true, "side_effects": "idempotent", "tools": {"read": {"side_effects": "none"}}`)+`,`+
		grpcSource("u", `, "tools": {"get": {"side_effects": "none"}}`)+`]}`, map[string]*fake{"s": f, "u": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 6 })
	want := map[string]catalog.SideEffects{"s__read": catalog.None, "s__write": catalog.Idempotent, "s__get": catalog.Idempotent,
		"u__read": catalog.Irreversible, "u__write": catalog.Irreversible, "u__get": catalog.None}
	for _, tl := range r.Tools("") {
		if w, ok := want[tl.Name]; ok && tl.SideEffects != w {
			t.Errorf("%s: %v, want %v", tl.Name, tl.SideEffects, w)
		}
	}
}

func TestCollisions(t *testing.T) {
	var logs syncBuffer
	a := &fake{tools: []source.Tool{{Name: "read.file"}, {Name: "read_file"}, {Name: "ok"}}}
	r := open(t, `{"sources": [`+grpcSource("a", "")+`]}`, map[string]*fake{"a": a}, nil, &logs)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 2 })
	got := names(r, "")
	if strings.Join(got, ",") != "a__ok,a__read_file" {
		t.Fatalf("tools %v", got)
	}
	// The first listed keeps the name.
	p, err := r.Prepare("", "a__read_file", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Run(context.Background(), source.Meta{}, func(*meshv1.Progress) {}); err != nil {
		t.Fatal(err)
	}
	if a.calls[0].Tool != "read.file" {
		t.Errorf("called %q, want the first listed, read.file", a.calls[0].Tool)
	}
	if l := logs.String(); !strings.Contains(l, `tool \"read_file\" of source a is named a__read_file, as tool \"read.file\" of source a is: the former is skipped`) {
		t.Errorf("collision not logged as expected:\n%s", l)
	}
}

func TestSchemaValidation(t *testing.T) {
	f := &fake{tools: []source.Tool{{Name: "search", InputSchema: json.RawMessage(`{"type": "object", "required": ["query"],
		"properties": {"query": {"type": "string", "minLength": 1}, "limit": {"type": "integer", "maximum": 50},
		"filters": {"type": "array", "items": {"type": "string"}}}, "additionalProperties": false}`)},
		{Name: "broken", InputSchema: json.RawMessage(`{"type": 5}`)}, {Name: "any"}}}
	r := open(t, `{"sources": [`+grpcSource("gh", "")+`]}`, map[string]*fake{"gh": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 2 }) // broken is skipped
	for _, tc := range []struct{ args, want string }{
		{`{}`, `args: missing property 'query'`},
		{`{"query": 5}`, `args.query: got number, want string`},
		{`{"query": "x", "limit": 51}`, `args.limit: maximum: got 51, want 50`},
		{`{"query": "x", "filters": ["a", 2]}`, `args.filters[1]: got number, want string`},
		{`{"query": "x", "sort": "asc"}`, `args: additional properties 'sort' not allowed`},
		{`[1]`, `args: must be a JSON object`},
		{`{"query":`, `args: not JSON`},
	} {
		_, err := r.Prepare("", "gh__search", []byte(tc.args))
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), tc.want) {
			t.Errorf("args %s: %v, want INVALID_ARGUMENT with %q", tc.args, err, tc.want)
		}
	}
	if _, err := r.Prepare("", "gh__search", []byte(`{"query": "x", "filters": ["a"]}`)); err != nil {
		t.Errorf("valid args: %v", err)
	}
	if _, err := r.Prepare("", "gh__any", nil); err != nil {
		t.Errorf("no args, no schema: %v", err)
	}
	if _, err := r.Prepare("", "gh__broken", nil); status.Code(err) != codes.NotFound {
		t.Errorf("tool with a broken schema: %v, want NOT_FOUND", err)
	}
	if f.attempts() != 0 {
		t.Errorf("%d calls sent; validation must send none", f.attempts())
	}
}

func TestTenants(t *testing.T) {
	f := &fake{tools: []source.Tool{{Name: "open"}, {Name: "secret"}}}
	r := open(t, `{"sources": [`+grpcSource("s", `, "tools": {"secret": {"tenants": ["acme"]}}`)+`,`+
		grpcSource("p", `, "tenants": ["acme"]`)+`,`+grpcSource("down", `, "tenants": ["acme"]`)+`]}`,
		map[string]*fake{"s": f, "p": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "acme")) == 4 })
	if got := strings.Join(names(r, "beta"), ","); got != "s__open" {
		t.Errorf("beta sees %s, want s__open", got)
	}
	for _, name := range []string{"s__secret", "p__open", "down__x"} {
		_, err := r.Prepare("beta", name, nil)
		if status.Code(err) != codes.NotFound || status.Convert(err).Message() != `unknown tool "`+name+`"` {
			t.Errorf("beta calls %s: %v, want NOT_FOUND as for any unknown tool", name, err)
		}
	}
	if _, err := r.Prepare("acme", "s__secret", nil); err != nil {
		t.Errorf("acme calls s__secret: %v", err)
	}
	if _, err := r.Prepare("acme", "down__x", nil); status.Code(err) != codes.Unavailable {
		t.Errorf("acme calls a tool of a down source: %v, want UNAVAILABLE", err)
	}
}

func TestConcurrency(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{}, 4)
	f := &fake{tools: []source.Tool{{Name: "slow"}, {Name: "other"}}, call: func(ctx context.Context, c source.Call) (source.Result, error) {
		if c.Tool == "slow" {
			started <- struct{}{}
			<-release
		}
		return source.Result{Output: json.RawMessage(`1`)}, nil
	}}
	r := open(t, `{"sources": [`+grpcSource("s", `, "concurrency": 2, "tools": {"slow": {"concurrency": 1}}`)+`]}`, map[string]*fake{"s": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 2 })
	run := func(name string) error {
		p, err := r.Prepare("", name, nil)
		if err != nil {
			return err
		}
		_, err = p.Run(context.Background(), source.Meta{}, func(*meshv1.Progress) {})
		return err
	}
	errc := make(chan error, 1)
	go func() { errc <- run("s__slow") }()
	<-started
	// The tool's own bound (1) is full; the source's (2) is not.
	if err := run("s__slow"); status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "1 calls in flight") {
		t.Errorf("second slow call: %v, want RESOURCE_EXHAUSTED naming the bound", err)
	}
	if err := run("s__other"); err != nil {
		t.Errorf("other tool while slow runs: %v", err)
	}
	close(release)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if err := run("s__slow"); err != nil {
		t.Errorf("slow after the first ended: %v", err)
	}
}

func TestSourceBoundSharedByTools(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	f := &fake{tools: []source.Tool{{Name: "a"}, {Name: "b"}}, call: func(ctx context.Context, c source.Call) (source.Result, error) {
		started <- struct{}{}
		<-release
		return source.Result{}, nil
	}}
	r := open(t, `{"sources": [`+grpcSource("s", `, "concurrency": 1`)+`]}`, map[string]*fake{"s": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 2 })
	pa, _ := r.Prepare("", "s__a", nil)
	pb, _ := r.Prepare("", "s__b", nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = pa.Run(context.Background(), source.Meta{}, func(*meshv1.Progress) {})
	}()
	<-started
	if _, err := pb.Run(context.Background(), source.Meta{}, func(*meshv1.Progress) {}); status.Code(err) != codes.ResourceExhausted ||
		!strings.Contains(err.Error(), "source s already has 1 calls in flight") {
		t.Errorf("b while a runs: %v", err)
	}
	close(release)
	<-done
}

func TestMinTime(t *testing.T) {
	f := &fake{tools: []source.Tool{{Name: "t"}}}
	r := open(t, `{"sources": [`+grpcSource("s", `, "min_time": "500ms"`)+`]}`, map[string]*fake{"s": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 1 })
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	p, err := r.Prepare("", "s__t", nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.Run(ctx, source.Meta{}, func(*meshv1.Progress) {})
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "no time left to start tool s__t") {
		t.Errorf("%v, want DEADLINE_EXCEEDED no time left to start tool s__t", err)
	}
	if f.attempts() != 0 {
		t.Error("a call was sent")
	}
}

func TestOutputCap(t *testing.T) {
	f := &fake{tools: []source.Tool{{Name: "big"}}, call: func(context.Context, source.Call) (source.Result, error) {
		return source.Result{Output: json.RawMessage(`"` + strings.Repeat("x", 100) + `"`)}, nil
	}}
	r := open(t, `{"sources": [`+grpcSource("s", `, "max_output_bytes": 50`)+`]}`, map[string]*fake{"s": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 1 })
	p, _ := r.Prepare("", "s__big", nil)
	_, err := p.Run(context.Background(), source.Meta{}, func(*meshv1.Progress) {})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "exceeds max_output_bytes (50)") {
		t.Errorf("%v, want FAILED_PRECONDITION naming the cap", err)
	}
}

// Retries follow the side effects: idempotent and none tools are retried; an irreversible
// one only with an idempotency key; a tool's own failure never.
func TestRetries(t *testing.T) {
	for _, tc := range []struct {
		name, policy string
		key          string
		failures     int  // UNAVAILABLE answers before success
		toolError    bool // the tool fails in its own terms instead
		attempts     int
		wantCode     codes.Code
		exhausted    bool
	}{
		{"idempotent, retried", `"side_effects": "idempotent"`, "", 2, false, 3, codes.OK, false},
		{"none, retried to exhaustion", `"side_effects": "none", "retry": {"max_attempts": 2}`, "", 5, false, 2, codes.Unavailable, true},
		{"irreversible without a key, once", ``, "", 1, false, 1, codes.Unavailable, false},
		{"irreversible with a key, retried", ``, "k1", 1, false, 2, codes.OK, false},
		{"retries off", `"side_effects": "none", "retry": {"disabled": true}`, "", 1, false, 1, codes.Unavailable, false},
		{"tool error, once", `"side_effects": "none"`, "", 0, true, 1, codes.OK, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fake{tools: []source.Tool{{Name: "t"}}}
			n := 0
			f.call = func(context.Context, source.Call) (source.Result, error) {
				n++
				if tc.toolError {
					return source.Result{IsError: true, Text: "bad repo"}, nil
				}
				if n <= tc.failures {
					return source.Result{}, status.Error(codes.Unavailable, "connection reset")
				}
				return source.Result{Output: json.RawMessage(`1`)}, nil
			}
			r := open(t, `{"sources": [`+grpcSource("s", `, "retry": {"base": "1ms", "cap": "2ms"}, "tools": {"t": {`+tc.policy+`}}`)+`]}`,
				map[string]*fake{"s": f}, nil, nil)
			eventually(t, "lists", func() bool { return len(names(r, "")) == 1 })
			p, _ := r.Prepare("", "s__t", nil)
			res, err := p.Run(context.Background(), source.Meta{IdempotencyKey: tc.key, Attempt: 1}, func(*meshv1.Progress) {})
			if status.Code(err) != tc.wantCode || f.attempts() != tc.attempts || retry.IsExhausted(err) != tc.exhausted {
				t.Fatalf("%v after %d attempts (exhausted %v), want %v after %d (exhausted %v)", err, f.attempts(), retry.IsExhausted(err), tc.wantCode, tc.attempts, tc.exhausted)
			}
			if tc.toolError && (!res.IsError || res.Text != "bad repo") {
				t.Errorf("result %+v", res)
			}
			for i, c := range f.calls {
				if c.Meta.Attempt != i+1 || c.Meta.IdempotencyKey != tc.key {
					t.Errorf("call %d: meta %+v", i, c.Meta)
				}
			}
		})
	}
}

// A source that cannot be reached: its tools fail UNAVAILABLE with the reason, its
// breaker opens, listing goes on with backoff; once it answers, its tools work.
func TestDownThenUp(t *testing.T) {
	reg := prometheus.NewRegistry()
	ch := make(chan struct{})
	f := &fake{listErr: errors.New("dial tcp 127.0.0.1:1: connection refused"), tools: []source.Tool{{Name: "t"}}, changed: ch}
	r := open(t, `{"sources": [`+grpcSource("s", "")+`]}`, map[string]*fake{"s": f}, reg, nil)
	eventually(t, "the breaker opens", func() bool {
		return metric(t, reg, "curfew_circuit_breaker_transitions_total", map[string]string{"target": "tool:s", "from": "closed", "to": "open"}) >= 1
	})
	_, err := r.Prepare("", "s__t", nil)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "connection refused") {
		t.Errorf("call while down: %v, want UNAVAILABLE with the reason", err)
	}
	f.set(func(f *fake) { f.listErr = nil })
	eventually(t, "the source lists", func() bool { return len(names(r, "")) == 1 })
	p, err := r.Prepare("", "s__t", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Run(context.Background(), source.Meta{}, func(*meshv1.Progress) {}); err != nil {
		t.Fatal(err)
	}
	if v := testutil.ToFloat64(r.calls.WithLabelValues("s", "s__t", "ok")); v != 1 {
		t.Errorf("curfew_tool_calls_total{outcome=ok} = %v", v)
	}
	// Down again after a list: the last list is kept, calls fail UNAVAILABLE.
	f.set(func(f *fake) { f.listErr = errors.New("server exited"); f.changed = nil })
	close(ch)
	eventually(t, "the source is down again", func() bool {
		_, err := r.Prepare("", "s__t", nil)
		return status.Code(err) == codes.Unavailable && strings.Contains(err.Error(), "server exited")
	})
}

// A source that never opens is retried; a call naming it is UNAVAILABLE, not NOT_FOUND.
func TestNeverOpens(t *testing.T) {
	r := open(t, `{"sources": [`+grpcSource("gone", "")+`]}`, map[string]*fake{}, nil, nil)
	eventually(t, "a failed open", func() bool {
		_, err := r.Prepare("", "gone__t", nil)
		return strings.Contains(err.Error(), "connection refused")
	})
	_, err := r.Prepare("", "gone__t", nil)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "source gone is down") {
		t.Errorf("%v", err)
	}
	if _, err := r.Prepare("", "other__t", nil); status.Code(err) != codes.NotFound {
		t.Errorf("a tool of no source: %v, want NOT_FOUND", err)
	}
}

// Ready returns once every source has been tried, listed or not: a source that answers
// has its tools by then, and one that is down does not hold it.
func TestReadyAfterEverySourceTried(t *testing.T) {
	up := &fake{tools: []source.Tool{{Name: "t"}}}
	down := &fake{listErr: errors.New("connection refused")}
	r := open(t, `{"sources": [`+grpcSource("up", "")+`, `+grpcSource("down", "")+`, `+grpcSource("gone", "")+`]}`,
		map[string]*fake{"up": up, "down": down}, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.Ready(ctx); err != nil {
		t.Fatalf("Ready: %v", err)
	}
	if _, err := r.Prepare("", "up__t", nil); err != nil {
		t.Errorf("the source that answered: %v, want its tool ready", err)
	}
	if _, err := r.Prepare("", "down__t", nil); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "connection refused") {
		t.Errorf("the source that is down: %v, want UNAVAILABLE with its reason", err)
	}
}

// Changed makes the registry list again.
func TestChanged(t *testing.T) {
	ch := make(chan struct{})
	f := &fake{tools: []source.Tool{{Name: "a"}}, changed: ch}
	r := open(t, `{"sources": [`+grpcSource("s", "")+`]}`, map[string]*fake{"s": f}, nil, nil)
	eventually(t, "lists", func() bool { return len(names(r, "")) == 1 })
	f.set(func(f *fake) { f.tools = append(f.tools, source.Tool{Name: "b"}); f.changed = make(chan struct{}) })
	close(ch)
	eventually(t, "lists again", func() bool { return len(names(r, "")) == 2 })
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if !f.closed {
		t.Error("Close did not close the source")
	}
}

func TestBuiltinsListed(t *testing.T) {
	r := open(t, `{"sources": []}`, nil, nil, nil)
	var got []string
	for _, tl := range r.Tools("") {
		got = append(got, tl.Name)
	}
	if strings.Join(got, ",") != "sleep,deploy,kv_put,notify,spawn_subagent" {
		t.Errorf("built-ins listed: %v", got)
	}
	if _, err := r.Prepare("", "sleep", nil); status.Code(err) != codes.Internal {
		t.Errorf("Prepare of a built-in: %v", err)
	}
}

func TestNewNeedsOpeners(t *testing.T) {
	cfg, err := Parse([]byte(`{"sources": [`+grpcSource("s", "")+`]}`), lookupEnv, lookPath)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := New(cfg, Options{Logger: quiet()}); err == nil || !strings.Contains(err.Error(), `no opener for kind "grpc"`) {
		t.Errorf("%v", err)
	}
}

// metric returns the value of the series of name with labels in reg, 0 when absent.
func metric(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
					continue next
				}
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// syncBuffer is a log sink safe for the registry's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// The source's late messages are counted per source; every source is exported at 0.
func TestLateMessagesMetric(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg, err := Parse([]byte(`{"sources": [`+grpcSource("a", "")+`,`+grpcSource("b", "")+`]}`), lookupEnv, lookPath)
	if err != nil {
		t.Fatal(err)
	}
	hooks := make(chan Hooks, 2)
	opener := func(_ context.Context, sc SourceConfig, h Hooks) (source.Source, error) {
		if sc.Name == "a" {
			hooks <- h
		}
		return &fake{}, nil
	}
	r, err := New(cfg, Options{Openers: map[string]Opener{KindGRPC: opener}, Registerer: reg, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.Close() }()
	h := <-hooks
	h.Late()
	h.Late()
	if v := metric(t, reg, "curfew_tool_late_messages_total", map[string]string{"source": "a"}); v != 2 {
		t.Errorf("late{a} = %v, want 2", v)
	}
	if v := metric(t, reg, "curfew_tool_late_messages_total", map[string]string{"source": "b"}); v != 0 {
		t.Errorf("late{b} = %v, want 0", v)
	}
}
