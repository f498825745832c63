package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"reflect"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// Defaults of Options' zero fields.
const (
	// DefaultListTimeout bounds one listing of a source.
	DefaultListTimeout = 30 * time.Second
	// DefaultOpenTimeout bounds one opening of a source (a process's start and
	// handshake, a connection).
	DefaultOpenTimeout = 30 * time.Second
)

// DefaultRelist is the backoff between attempts to open or list a down source: full
// jitter, up to 200ms·2^(n−1) before attempt n+1, at most 30s.
var DefaultRelist = retry.Policy{Base: 200 * time.Millisecond, Cap: 30 * time.Second}

// Opener opens a source of a kind. It returns once the source is usable or failed; the
// registry calls it again, with backoff, after a failure. An opened source that goes
// down (its List fails) is kept and listed again with backoff: reconnecting, restarting
// a process, is the source's own business.
type Opener func(ctx context.Context, sc SourceConfig, h Hooks) (source.Source, error)

// Hooks are what the registry gives a source it opens.
type Hooks struct {
	// Late counts a message that arrived after its call ended (a progress report, a
	// reply); it feeds curfew_tool_late_messages_total{source}.
	Late func()
	// Logger logs for the source (with its name).
	Logger *slog.Logger
}

// Options configure a Registry.
type Options struct {
	// Openers open the sources by kind (KindMCPStdio, KindMCPHTTP, KindGRPC); New refuses a
	// configuration with a kind that has none.
	Openers map[string]Opener
	// Registerer, if set, receives the registry's metrics and its breakers'.
	Registerer prometheus.Registerer
	// Logger logs discovery (sources down and up, collisions, skipped tools);
	// slog.Default() when nil.
	Logger *slog.Logger
	// Breaker configures the sources' breakers (one per source, target "tool:<source>").
	Breaker breaker.Config
	// Relist is the backoff of a down source (DefaultRelist when zero).
	Relist retry.Policy
	// ListTimeout and OpenTimeout bound a listing and an opening (the defaults when 0).
	ListTimeout, OpenTimeout time.Duration
}

// Registry holds the configured sources and their tools. Its methods are safe for
// concurrent use.
type Registry struct {
	o        Options
	log      *slog.Logger
	base     context.Context // discovery's; Close cancels it
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	breakers *breaker.Set

	calls *prometheus.CounterVec
	late  *prometheus.CounterVec

	// rebuildMu makes rebuilds one at a time, so that the table stored last is made from
	// the newest lists: two rebuilds interleaved could store an older snapshot last.
	rebuildMu sync.Mutex

	mu         sync.RWMutex
	sources    []*src            // in the file's order
	byName     map[string]*src   // sources by name
	retired    []*src            // sources a reload removed, until they are closed
	closed     bool              // Close was called
	tools      map[string]*entry // by model-visible name
	collisions map[string]bool   // reported collisions, so each is logged once
}

// src is one source and what the registry knows of it.
type src struct {
	cfg     SourceConfig
	breaker *breaker.Breaker
	sem     chan struct{} // the source's calls in flight
	calls   *prometheus.CounterVec

	mu      sync.Mutex
	s       source.Source // nil until opened
	down    error         // why the source is down; nil when it is up
	listed  bool          // it listed at least once
	entries []*entry      // its tools as last listed, in its order
	toolSem map[string]chan struct{}

	tried     chan struct{} // closed once the first open and listing have succeeded or failed
	triedOnce sync.Once

	cancel context.CancelFunc // stops its discovery
	done   chan struct{}      // closed when its discovery has returned
	// Under mu: the calls running on s (Run), and whether a reload retired s; a retired
	// source is closed when its last call ends.
	active        int
	retiredByLoad bool
	closed        bool
}

// triedOnce marks s's first discovery attempt as over, whatever its outcome.
func (s *src) markTried() { s.triedOnce.Do(func() { close(s.tried) }) }

// entry is one tool of a source.
type entry struct {
	name    string // model-visible
	src     *src
	tool    source.Tool
	schema  *schema
	policy  resolved
	effects catalog.SideEffects
	sem     chan struct{} // the tool's own concurrency bound; nil for none
}

// resolved is a tool's policy with the source's and the defaults filled in.
type resolved struct {
	minTime        time.Duration
	retry          retry.Policy
	maxOutputBytes int
	tenants        map[string]bool // nil: every tenant
	approval       string          // why a call waits for a human's approval ("": it does not)
}

// New returns a registry of cfg's sources and starts opening and listing them in the
// background; Close stops it. It fails when a source's kind has no opener.
func New(cfg *Config, o Options) (*Registry, error) {
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Relist == (retry.Policy{}) {
		o.Relist = DefaultRelist
	}
	if o.ListTimeout == 0 {
		o.ListTimeout = DefaultListTimeout
	}
	if o.OpenTimeout == 0 {
		o.OpenTimeout = DefaultOpenTimeout
	}
	if err := o.Breaker.Validate(); err != nil {
		return nil, err
	}
	r := &Registry{o: o, log: o.Logger, byName: map[string]*src{}, tools: map[string]*entry{}, collisions: map[string]bool{},
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_tool_calls_total",
			Help: "Calls of tools from the registry's sources, by source, tool (model-visible name) and outcome: ok, tool_error, or the gRPC code of the failure.",
		}, []string{"source", "tool", "outcome"}),
		late: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_tool_late_messages_total",
			Help: "Messages from a tool source that arrived after their call had ended (progress reports, replies), dropped.",
		}, []string{"source"}),
	}
	if err := r.checkKinds(cfg); err != nil {
		return nil, err
	}
	r.breakers = breaker.NewSet(o.Breaker, o.Registerer)
	r.breakers.SetLogger(r.log)
	for _, sc := range cfg.Sources {
		s := r.newSrc(sc)
		r.sources = append(r.sources, s)
		r.byName[sc.Name] = s
	}
	if o.Registerer != nil {
		o.Registerer.MustRegister(r.calls, r.late)
	}
	r.base, r.cancel = context.WithCancel(context.Background())
	for _, s := range r.sources {
		r.startSrc(s)
	}
	return r, nil
}

// checkKinds fails when a source's kind has no opener.
func (r *Registry) checkKinds(cfg *Config) error {
	for _, sc := range cfg.Sources {
		if r.o.Openers[sc.Kind] == nil {
			return fmt.Errorf("tool source %s: no opener for kind %q", sc.Name, sc.Kind)
		}
	}
	return nil
}

// newSrc makes the state of the source sc, not yet discovering.
func (r *Registry) newSrc(sc SourceConfig) *src {
	conc := DefaultConcurrency
	if sc.Policy.Concurrency != nil {
		conc = *sc.Policy.Concurrency
	}
	r.late.WithLabelValues(sc.Name) // exported at 0
	return &src{cfg: sc, breaker: r.breakers.Get("tool:" + sc.Name), sem: make(chan struct{}, conc), calls: r.calls,
		down: errors.New("not listed yet"), toolSem: map[string]chan struct{}{}, tried: make(chan struct{})}
}

// startSrc starts s's discovery.
func (r *Registry) startSrc(s *src) {
	ctx, cancel := context.WithCancel(r.base)
	s.cancel, s.done = cancel, make(chan struct{})
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		defer close(s.done)
		r.discover(ctx, s)
	}()
}

// Update replaces the registry's sources with cfg's, as a reload of the tools file does
// (docs/tools.md, "Reloading the tools file"). A source whose entry in the file is
// unchanged keeps its session (its MCP process or connection), its tools and its calls.
// A new source is opened and listed in the background, as at start. A source removed,
// or whose entry changed in any way, leaves the tool list at once: calls not yet
// started on it are refused UNAVAILABLE, calls in flight run to their end (their own
// deadline and cancel), and then its session is closed; a changed source comes back as a
// new source with a new session. Breakers are kept by source name. On error (a kind
// without an opener) nothing changes.
func (r *Registry) Update(cfg *Config) error {
	if err := r.checkKinds(cfg); err != nil {
		return err
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return errors.New("tool registry: closed")
	}
	var (
		next         []*src
		byName       = map[string]*src{}
		added, gone  []*src
		kept         = map[*src]bool{}
		stillRetired []*src
	)
	for _, sc := range cfg.Sources {
		s := r.byName[sc.Name]
		if s == nil || !reflect.DeepEqual(s.cfg, sc) {
			s = r.newSrc(sc)
			added = append(added, s)
		} else {
			kept[s] = true
		}
		next = append(next, s)
		byName[sc.Name] = s
	}
	for _, s := range r.sources {
		if !kept[s] {
			gone = append(gone, s)
		}
	}
	for _, s := range r.retired {
		s.mu.Lock()
		if !s.closed {
			stillRetired = append(stillRetired, s)
		}
		s.mu.Unlock()
	}
	stillRetired = append(stillRetired, gone...)
	r.sources, r.byName, r.retired = next, byName, stillRetired
	for _, s := range added {
		r.startSrc(s)
	}
	r.mu.Unlock()
	r.rebuild() // the retired sources' tools leave the list now
	for _, s := range gone {
		r.retire(s)
	}
	r.log.Info("tool sources reloaded", "kept", len(kept), "opened", len(added), "retired", len(gone))
	return nil
}

// retire stops s's discovery and closes its session once no call runs on it.
func (r *Registry) retire(s *src) {
	s.cancel()
	<-s.done
	s.mu.Lock()
	s.retiredByLoad = true
	cur := s.closeLocked()
	s.mu.Unlock()
	r.closeSession(s, cur)
}

// closeLocked marks s closed and returns its session when it is retired, no call runs on
// it and it has one not yet closed; nil otherwise. s.mu is held.
func (s *src) closeLocked() source.Source {
	if !s.retiredByLoad || s.active > 0 || s.closed || s.s == nil {
		return nil
	}
	s.closed = true
	return s.s
}

// closeSession closes a retired source's session (nil: nothing to close).
func (r *Registry) closeSession(s *src, cur source.Source) {
	if cur == nil {
		return
	}
	if err := cur.Close(); err != nil {
		r.log.Warn("closing a tool source retired by a reload", "source", s.cfg.Name, "error", err.Error())
		return
	}
	r.log.Info("tool source retired by a reload is closed", "source", s.cfg.Name)
}

// begin counts a call on s and returns its session and why it is down, or ok false
// when a reload retired s.
func (s *src) begin() (cur source.Source, ok bool, down error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.retiredByLoad {
		return nil, false, nil
	}
	s.active++
	return s.s, true, s.down
}

// end ends a call begun on s, closing s's session if s was retired meanwhile and this
// was its last call.
func (r *Registry) end(s *src) {
	s.mu.Lock()
	s.active--
	cur := s.closeLocked()
	s.mu.Unlock()
	r.closeSession(s, cur)
}

// Ready waits until every source has been opened and listed once, or has failed to be,
// or until ctx ends (it then returns ctx's error). toolrunner waits for it before it
// serves, bounded, so that a run started as soon as the mesh is ready finds the tools of
// every source that is up; a source that is down stays down without holding the start.
func (r *Registry) Ready(ctx context.Context) error {
	r.mu.RLock()
	sources := r.sources
	r.mu.RUnlock()
	for _, s := range sources {
		select {
		case <-s.tried:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// Close stops discovery and closes the sources.
// Calls still running on a source end as their session closes.
func (r *Registry) Close() error {
	r.mu.Lock()
	r.closed = true
	sources := append(append([]*src(nil), r.sources...), r.retired...)
	r.mu.Unlock()
	r.cancel()
	r.wg.Wait()
	var errs []error
	for _, s := range sources {
		s.mu.Lock()
		if s.s != nil && !s.closed {
			s.closed = true
			if err := s.s.Close(); err != nil {
				errs = append(errs, fmt.Errorf("tool source %s: %w", s.cfg.Name, err))
			}
		}
		s.mu.Unlock()
	}
	return errors.Join(errs...)
}

// discover opens s, lists it, and lists it again whenever it says its list changed; while
// it is down it tries again with backoff.
func (r *Registry) discover(ctx context.Context, s *src) {
	log := r.log.With("source", s.cfg.Name)
	failures := 0
	defer s.markTried() // (discovery stopped before a first outcome)
	fail := func(err error, wait time.Duration) bool {
		defer s.markTried()
		failures++
		s.mu.Lock()
		was := s.down
		if !breaker.IsOpen(err) || was == nil {
			s.down = err // (a refusal of the breaker keeps the reason it opened for)
		}
		s.mu.Unlock()
		if was == nil || failures == 1 {
			log.Warn("tool source down", "error", err.Error())
		}
		if wait == 0 {
			wait = r.o.Relist.Backoff(min(failures, 30)+1, rand.Float64)
		}
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
			return true
		}
	}
	for ctx.Err() == nil {
		s.mu.Lock()
		cur := s.s
		s.mu.Unlock()
		if cur == nil {
			octx, cancel := context.WithTimeout(ctx, r.o.OpenTimeout)
			opened, err := r.o.Openers[s.cfg.Kind](octx, s.cfg, Hooks{Late: r.late.WithLabelValues(s.cfg.Name).Inc, Logger: log})
			cancel()
			if err != nil {
				if !fail(fmt.Errorf("opening: %w", err), 0) {
					return
				}
				continue
			}
			s.mu.Lock()
			s.s, cur = opened, opened
			s.mu.Unlock()
		}
		// Subscribe before listing, so that a change during the listing is not missed.
		changed := cur.Changed()
		tools, err := r.list(ctx, s, cur)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			var wait time.Duration
			if oe, ok := breaker.Open(err); ok {
				wait = oe.RetryAfter // the breaker says when it lets a probe through
			}
			if !fail(err, wait) {
				return
			}
			continue
		}
		failures = 0
		r.setTools(s, tools, log)
		s.markTried()
		select {
		case <-ctx.Done():
			return
		case <-changed: // nil: never
			log.Info("tool source changed its list")
		}
	}
}

// list lists s through its breaker.
func (r *Registry) list(ctx context.Context, s *src, cur source.Source) ([]source.Tool, error) {
	done, err := s.breaker.Allow(ctx)
	if err != nil {
		return nil, err
	}
	lctx, cancel := context.WithTimeout(ctx, r.o.ListTimeout)
	defer cancel()
	tools, err := cur.List(lctx)
	if err != nil {
		if _, ok := status.FromError(err); !ok {
			err = status.Error(codes.Unavailable, err.Error())
		}
	}
	done(err)
	return tools, err
}

// setTools records s's new list and rebuilds the name table.
func (r *Registry) setTools(s *src, tools []source.Tool, log *slog.Logger) {
	var entries []*entry
	seen := map[string]bool{}
	for _, t := range tools {
		if seen[t.Name] {
			log.Warn("tool source lists a tool twice; the later is skipped", "tool", t.Name)
			continue
		}
		seen[t.Name] = true
		sch, err := compileSchema(t.InputSchema)
		if err != nil {
			log.Warn("tool skipped: its input schema does not compile", "tool", t.Name, "error", err.Error())
			continue
		}
		e := &entry{name: Name(s.cfg.Name, t.Name), src: s, tool: t, schema: sch}
		e.policy, e.effects = resolve(s.cfg, t)
		if p, ok := s.cfg.Tools[t.Name]; ok && p.Concurrency != nil {
			s.mu.Lock()
			if s.toolSem[t.Name] == nil || cap(s.toolSem[t.Name]) != *p.Concurrency {
				s.toolSem[t.Name] = make(chan struct{}, *p.Concurrency)
			}
			e.sem = s.toolSem[t.Name]
			s.mu.Unlock()
		}
		entries = append(entries, e)
	}
	for name := range s.cfg.Tools {
		if !seen[name] {
			log.Warn("the configuration sets a policy for a tool the source does not list", "tool", name)
		}
	}
	s.mu.Lock()
	wasDown := s.down
	s.entries, s.down, s.listed = entries, nil, true
	s.mu.Unlock()
	if wasDown != nil {
		log.Info("tool source up", "tools", len(entries))
	}
	r.rebuild()
}

// rebuild makes the name table from every source's last list. Sources are taken in the
// file's order and tools in their source's: of two tools with one name, the later one is
// skipped and logged (once).
func (r *Registry) rebuild() {
	r.rebuildMu.Lock()
	defer r.rebuildMu.Unlock()
	table := map[string]*entry{}
	var clashes []string
	r.mu.RLock()
	sources := r.sources
	r.mu.RUnlock()
	for _, s := range sources {
		s.mu.Lock()
		entries := s.entries
		s.mu.Unlock()
		for _, e := range entries {
			if first := table[e.name]; first != nil {
				clashes = append(clashes, fmt.Sprintf("tool %q of source %s is named %s, as tool %q of source %s is: the former is skipped",
					e.tool.Name, e.src.cfg.Name, e.name, first.tool.Name, first.src.cfg.Name))
				continue
			}
			table[e.name] = e
		}
	}
	r.mu.Lock()
	r.tools = table
	var fresh []string
	for _, c := range clashes {
		if !r.collisions[c] {
			r.collisions[c] = true
			fresh = append(fresh, c)
		}
	}
	r.mu.Unlock()
	for _, c := range fresh {
		r.log.Error("tool name collision", "detail", c)
	}
}

// resolve returns a tool's policy: its override's fields, else its source's, else the
// defaults.
func resolve(sc SourceConfig, t source.Tool) (resolved, catalog.SideEffects) {
	tp, sp := sc.Tools[t.Name], sc.Policy
	out := resolved{minTime: DefaultMinTime, maxOutputBytes: DefaultMaxOutputBytes}
	if p := first(tp.MinTime, sp.MinTime); p != nil {
		out.minTime = *p
	}
	if p := first(tp.MaxOutputBytes, sp.MaxOutputBytes); p != nil {
		out.maxOutputBytes = *p
	}
	tenants := tp.Tenants
	if tenants == nil {
		tenants = sp.Tenants
	}
	if tenants != nil {
		out.tenants = map[string]bool{}
		for _, t := range tenants {
			out.tenants[t] = true
		}
	}
	rp := retry.Policy{}
	if sp.Retry != nil {
		rp = sp.Retry.Apply(rp)
	}
	if tp.Retry != nil {
		rp = tp.Retry.Apply(rp)
	}
	out.approval = Approval(first(tp.Approval, sp.Approval), t.Hints)
	effects := Effects(first(tp.SideEffects, sp.SideEffects), sc.Trusted, t.Hints)
	rp.NonIdempotent = effects == catalog.Irreversible
	out.retry = rp.WithDefaults()
	return out, effects
}

func first[T any](a, b *T) *T {
	if a != nil {
		return a
	}
	return b
}

func (e *entry) allows(tenant string) bool {
	return e.policy.tenants == nil || e.policy.tenants[tenant]
}

// Tool describes a tool the registry lists.
type Tool struct {
	// Name is the model-visible name: the bare name of a built-in, source__tool else.
	Name string
	// Source is the source's name (BuiltinSource for a built-in).
	Source      string
	Description string
	// InputSchema is the JSON Schema of the arguments; nil means any object.
	InputSchema json.RawMessage
	SideEffects catalog.SideEffects
	// Approval says why a call of the tool waits for a human's approval before its
	// effect (ApprovalRegistry, ApprovalDestructiveHint); "" when it does not.
	Approval string
}

// Tools returns the tools tenant may call: the built-ins models are told of, then the
// sources' tools by name, of the sources listed so far.
func (r *Registry) Tools(tenant string) []Tool {
	var out []Tool
	for _, b := range catalog.Builtins() {
		if b.Spec != nil {
			out = append(out, Tool{Name: b.Name, Source: BuiltinSource, Description: b.Spec.GetDescription(),
				InputSchema: json.RawMessage(b.Spec.GetParametersJson()), SideEffects: b.SideEffects})
		}
	}
	r.mu.RLock()
	names := sortedKeys(r.tools)
	for _, n := range names {
		if e := r.tools[n]; e.allows(tenant) {
			out = append(out, Tool{Name: n, Source: e.src.cfg.Name, Description: e.tool.Description, InputSchema: e.tool.InputSchema, SideEffects: e.effects,
				Approval: e.policy.approval})
		}
	}
	r.mu.RUnlock()
	return out
}

// Prepared is a checked call of a tool, ready to run.
type Prepared struct {
	r    *Registry
	e    *entry
	args json.RawMessage
}

// Prepare checks a call of the tool named name by tenant with args (a JSON object; empty
// is {}), before anything is sent: NOT_FOUND for a tool the registry does not have or
// that tenant may not call (the same answer, so that a tenant learns nothing of another's
// tools); UNAVAILABLE, with the reason, when the tool's source is down; INVALID_ARGUMENT
// naming the argument and the rule when args do not satisfy the tool's input schema.
func (r *Registry) Prepare(tenant, name string, args []byte) (*Prepared, error) {
	if catalog.IsBuiltin(name) {
		return nil, status.Errorf(codes.Internal, "tool %s is a built-in: toolrunner runs it itself", name)
	}
	r.mu.RLock()
	e, s := r.tools[name], r.byName[SourceOf(name)]
	r.mu.RUnlock()
	if e == nil || !e.allows(tenant) {
		// A source that has never listed: its tools are not known, but a call naming it
		// learns that it is down rather than that the tool does not exist.
		if s != nil && e == nil {
			s.mu.Lock()
			listed, down := s.listed, s.down
			s.mu.Unlock()
			if !listed && down != nil && (s.cfg.Policy.Tenants == nil || contains(s.cfg.Policy.Tenants, tenant)) {
				return nil, status.Errorf(codes.Unavailable, "tool %s: source %s is down, its tools unknown yet: %s", name, s.cfg.Name, reason(down))
			}
		}
		return nil, status.Errorf(codes.NotFound, "unknown tool %q", name)
	}
	e.src.mu.Lock()
	down := e.src.down
	e.src.mu.Unlock()
	if down != nil {
		return nil, status.Errorf(codes.Unavailable, "tool %s: source %s is down: %s", name, e.src.cfg.Name, reason(down))
	}
	if len(args) == 0 {
		args = []byte("{}")
	}
	if err := e.schema.validate(args); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "tool %s: %v", name, err)
	}
	return &Prepared{r: r, e: e, args: args}, nil
}

// reason is why a source is down: a status's message, or the error.
func reason(err error) string {
	if err == nil {
		return "being opened again"
	}
	if st, ok := status.FromError(err); ok {
		return st.Message()
	}
	return err.Error()
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// SideEffects returns the tool's resolved side effects.
func (p *Prepared) SideEffects() catalog.SideEffects { return p.e.effects }

// Approval says why a call of the tool waits for a human's approval before its effect
// (ApprovalRegistry, ApprovalDestructiveHint); "" when it does not.
func (p *Prepared) Approval() string { return p.e.policy.approval }

// MinTime is the least time the tool needs left before the deadline to start: a wait
// for approval ends that long before the deadline.
func (p *Prepared) MinTime() time.Duration { return p.e.policy.minTime }

// Run runs the call under the tool's policy: DEADLINE_EXCEEDED "no time left to start
// tool X" with less than its min_time left; RESOURCE_EXHAUSTED at once when its source or
// the tool has its concurrency's calls in flight; attempts through the source's breaker,
// retried as retry.Policy decides with the tool's side effects (an irreversible tool only
// with meta's idempotency key), then marked exhausted; FAILED_PRECONDITION naming the
// cap when the result exceeds max_output_bytes. A tool's own failure is a Result with
// IsError, not retried. meta.Attempt is the caller's attempt; toolrunner's own attempts
// count on from it.
func (p *Prepared) Run(ctx context.Context, meta source.Meta, progress func(*meshv1.Progress)) (res source.Result, err error) {
	e := p.e
	defer func() { e.src.count(p, res, err) }()
	if err := deadline.Check(ctx, e.policy.minTime, "tool "+e.name); err != nil {
		return source.Result{}, err
	}
	release, err := e.acquire()
	if err != nil {
		return source.Result{}, err
	}
	defer release()
	cur, ok, down := e.src.begin()
	if !ok {
		return source.Result{}, status.Errorf(codes.Unavailable, "tool %s: source %s was removed or changed by a reload of the tools file", e.name, e.src.cfg.Name)
	}
	defer p.r.end(e.src)
	if cur == nil { // not opened (cannot happen after Prepare found its tools)
		return source.Result{}, status.Errorf(codes.Unavailable, "tool %s: source %s is down: %s", e.name, e.src.cfg.Name, reason(down))
	}
	first := max(meta.Attempt, 1)
	for n := 1; ; n++ {
		meta.Attempt = first + n - 1
		res, err = e.attempt(ctx, cur, p.args, meta, progress)
		if err == nil {
			if size := len(res.Output) + len(res.Text); size > e.policy.maxOutputBytes {
				return source.Result{}, status.Errorf(codes.FailedPrecondition, "tool %s: its result of %d bytes exceeds max_output_bytes (%d)", e.name, size, e.policy.maxOutputBytes)
			}
			return res, nil
		}
		if errors.Is(err, source.ErrTooLarge) {
			return source.Result{}, status.Errorf(codes.FailedPrecondition, "tool %s: %v", e.name, err)
		}
		if ctx.Err() != nil || breaker.IsOpen(err) {
			return source.Result{}, err
		}
		d := e.policy.retry.Decide(err, nil, n, deadline.Remaining(ctx, time.Now()), meta.IdempotencyKey != "", rand.Float64)
		switch d.Verdict {
		case retry.Retry:
		case retry.Exhausted:
			return source.Result{}, retry.MarkExhausted(err, n)
		case retry.NoTime:
			return source.Result{}, status.Errorf(codes.DeadlineExceeded, "no time left to retry tool %s after attempt %d (%s: %s)",
				e.name, n, status.Code(err), status.Convert(err).Message())
		default:
			return source.Result{}, err
		}
		t := time.NewTimer(d.Delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return source.Result{}, status.FromContextError(ctx.Err()).Err()
		case <-t.C:
		}
	}
}

// attempt makes one attempt through the source's breaker.
func (e *entry) attempt(ctx context.Context, cur source.Source, args json.RawMessage, meta source.Meta, progress func(*meshv1.Progress)) (source.Result, error) {
	done, err := e.src.breaker.Allow(ctx)
	if err != nil {
		return source.Result{}, err
	}
	res, err := cur.Call(ctx, source.Call{Tool: e.tool.Name, Args: args, Meta: meta}, progress)
	done(err)
	return res, err
}

// acquire takes a place in the source's and the tool's bounds, or fails at once.
func (e *entry) acquire() (release func(), err error) {
	select {
	case e.src.sem <- struct{}{}:
	default:
		return nil, status.Errorf(codes.ResourceExhausted, "tool %s: source %s already has %d calls in flight (its concurrency)", e.name, e.src.cfg.Name, cap(e.src.sem))
	}
	if e.sem == nil {
		return func() { <-e.src.sem }, nil
	}
	select {
	case e.sem <- struct{}{}:
	default:
		<-e.src.sem
		return nil, status.Errorf(codes.ResourceExhausted, "tool %s already has %d calls in flight (its concurrency)", e.name, cap(e.sem))
	}
	return func() { <-e.sem; <-e.src.sem }, nil
}

// count records a call's outcome.
func (s *src) count(p *Prepared, res source.Result, err error) {
	outcome := "ok"
	switch {
	case err != nil:
		outcome = status.Code(err).String()
	case res.IsError:
		outcome = "tool_error"
	}
	s.calls.WithLabelValues(s.cfg.Name, p.e.name, outcome).Inc()
}
