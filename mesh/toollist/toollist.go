package toollist

import (
	"context"
	"log/slog"
	"reflect"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// Defaults of Options' zero fields.
const (
	// DefaultTTL is how long a tenant's list is kept: the staleness bound.
	DefaultTTL = 5 * time.Second
	// DefaultTimeout bounds one ListTools call (within the caller's deadline), so that a
	// toolrunner that does not answer delays a model step by at most this much.
	DefaultTimeout = 2 * time.Second
)

// anyObject is the parameters of a tool whose schema says nothing: any object.
const anyObject = `{"type": "object"}`

// Options configure a Lister; the zero value takes the defaults.
type Options struct {
	// TTL is how long a tenant's list is kept; DefaultTTL when 0.
	TTL time.Duration
	// Timeout bounds one ListTools call; DefaultTimeout when 0.
	Timeout time.Duration
	// Logger receives the outage's one warning and its end; slog.Default() when nil.
	Logger *slog.Logger
}

// Client is what a Lister needs of toolrunner: ListTools
// (toolrunnerv1.ToolRunnerServiceClient has it).
type Client interface {
	ListTools(ctx context.Context, in *toolrunnerv1.ListToolsRequest, opts ...grpc.CallOption) (*toolrunnerv1.ListToolsResponse, error)
}

// Tools are the tools a tenant's model is told of, and what is known of their effects.
// A Tools is shared by its callers: they must not change what Specs returns.
type Tools struct {
	specs   []*modelproxyv1.ToolSpec
	effects map[string]catalog.SideEffects // the listed tools whose effects were said
	listed  bool
}

// builtins is the fallback: the built-ins' specs, effects from the catalogue.
var builtins = &Tools{specs: catalog.Specs()}

// Builtins returns the built-in tools only: what a model is told of when toolrunner
// has not answered.
func Builtins() *Tools { return builtins }

// Specs returns the tools' specs, to send to modelproxy (GenerateRequest.tools).
func (t *Tools) Specs() []*modelproxyv1.ToolSpec { return t.specs }

// Only returns the tools among t named in names, in t's order, as a Tools of their own;
// t itself when names is empty. A name t does not hold is ignored.
func (t *Tools) Only(names []string) *Tools {
	if len(names) == 0 {
		return t
	}
	o := &Tools{effects: t.effects, listed: t.listed}
	for _, s := range t.specs {
		if slices.Contains(names, s.GetName()) {
			o.specs = append(o.specs, s)
		}
	}
	return o
}

// Has reports whether t holds a tool of that name.
func (t *Tools) Has(name string) bool {
	return slices.ContainsFunc(t.specs, func(s *modelproxyv1.ToolSpec) bool { return s.GetName() == name })
}

// Listed reports whether the tools came from toolrunner (false: the built-ins' fallback).
func (t *Tools) Listed() bool { return t.listed }

// NeedsKey reports whether a call of the tool name may run a second time (a retry, a
// run resumed at it) only when it carries an idempotency key: for a built-in,
// catalog.NeedsKey; for a listed tool, whether its side effects are irreversible; for
// any other name, or a listed tool of unspecified effects, true.
func (t *Tools) NeedsKey(name string) bool {
	if catalog.IsBuiltin(name) {
		return catalog.NeedsKey(name)
	}
	e, ok := t.effects[name]
	return !ok || e == catalog.Irreversible
}

// Hedgeable reports whether a call of the tool name may get a hedged backup (package
// mesh/hedge): for a built-in, catalog.Hedgeable (never spawn_subagent, which runs model
// calls); for a listed tool, whether its side effects are none or idempotent; for any
// other name, or a listed tool of unspecified effects, false.
func (t *Tools) Hedgeable(name string) bool {
	if catalog.IsBuiltin(name) {
		return catalog.Hedgeable(name)
	}
	e, ok := t.effects[name]
	return ok && e != catalog.Irreversible
}

// FromResponse makes Tools of a ListTools answer. A tool with an empty schema is told
// to the model as taking any object.
func FromResponse(resp *toolrunnerv1.ListToolsResponse) *Tools {
	t := &Tools{effects: map[string]catalog.SideEffects{}, listed: true}
	for _, ti := range resp.GetTools() {
		if ti.GetName() == "" {
			continue
		}
		params := ti.GetInputSchemaJson()
		if params == "" {
			params = anyObject
		}
		t.specs = append(t.specs, &modelproxyv1.ToolSpec{Name: ti.GetName(), Description: ti.GetDescription(), ParametersJson: params})
		if e, ok := SideEffects(ti.GetSideEffects()); ok {
			t.effects[ti.GetName()] = e
		}
	}
	return t
}

// SideEffects translates the wire's side effects; ok is false for unspecified (or
// unknown) ones, which a caller must take as irreversible.
func SideEffects(e toolv1.SideEffects) (_ catalog.SideEffects, ok bool) {
	switch e {
	case toolv1.SideEffects_SIDE_EFFECTS_NONE:
		return catalog.None, true
	case toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT:
		return catalog.Idempotent, true
	case toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE:
		return catalog.Irreversible, true
	}
	return catalog.Irreversible, false
}

// Proto translates side effects to the wire's.
func Proto(e catalog.SideEffects) toolv1.SideEffects {
	switch e {
	case catalog.None:
		return toolv1.SideEffects_SIDE_EFFECTS_NONE
	case catalog.Idempotent:
		return toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT
	case catalog.Irreversible:
		return toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE
	}
	return toolv1.SideEffects_SIDE_EFFECTS_UNSPECIFIED
}

// Lister lists tenants' tools through toolrunner and keeps each tenant's list for the
// TTL. It is safe for concurrent use.
type Lister struct {
	c   Client
	o   Options
	log *slog.Logger

	mu       sync.Mutex
	byTenant map[string]*entry
	failing  bool // the last listing failed (its warning was logged)
}

// entry is one tenant's listing: in flight until ready is closed, then tools (nil when
// it failed, and the entry is gone from the map).
type entry struct {
	ready chan struct{}
	tools *Tools
	at    time.Time // when it was listed
}

// New returns a Lister asking c.
func New(c Client, o Options) *Lister {
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return &Lister{c: c, o: o, log: o.Logger, byTenant: map[string]*entry{}}
}

// Tools returns the tools of ctx's tenant (md.IdentityFrom): its list, kept for the TTL;
// else toolrunner is asked (one call for the callers that come while it runs); when it
// does not answer, Builtins. It never fails.
func (l *Lister) Tools(ctx context.Context) *Tools {
	tenant := md.IdentityFrom(ctx).Tenant
	now := time.Now()
	l.mu.Lock()
	e := l.byTenant[tenant]
	if e != nil && e.done() && now.Sub(e.at) >= l.o.TTL {
		e = nil // stale
	}
	if e != nil {
		l.mu.Unlock()
		select {
		case <-e.ready:
		case <-ctx.Done():
			return Builtins()
		}
		if e.tools == nil {
			return Builtins()
		}
		return e.tools
	}
	e = &entry{ready: make(chan struct{})}
	l.prune(now)
	l.byTenant[tenant] = e
	l.mu.Unlock()

	lctx, cancel := context.WithTimeout(ctx, l.o.Timeout)
	resp, err := l.c.ListTools(lctx, &toolrunnerv1.ListToolsRequest{})
	cancel()
	l.mu.Lock()
	if err != nil {
		if l.byTenant[tenant] == e {
			delete(l.byTenant, tenant) // nothing kept: the next step asks again
		}
		if !l.failing {
			l.failing = true
			l.log.WarnContext(ctx, "toolrunner did not list the tools: models are told of the built-in tools only until it does",
				"tenant", tenant, "code", status.Code(err).String(), "error", err.Error())
		}
	} else {
		e.tools, e.at = FromResponse(resp), time.Now()
		if l.failing {
			l.failing = false
			l.log.InfoContext(ctx, "toolrunner lists the tools again", "tenant", tenant, "tools", len(e.tools.specs))
		}
	}
	l.mu.Unlock()
	close(e.ready)
	if e.tools == nil {
		return Builtins()
	}
	return e.tools
}

// Invalidate drops tenant's list, so that the next Tools asks toolrunner: a caller found
// a listed tool gone.
func (l *Lister) Invalidate(tenant string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if e := l.byTenant[tenant]; e != nil && e.done() {
		delete(l.byTenant, tenant)
	}
}

// prune forgets the stale lists of tenants that stopped asking. Called with l.mu held.
func (l *Lister) prune(now time.Time) {
	for t, e := range l.byTenant {
		if e.done() && now.Sub(e.at) >= l.o.TTL {
			delete(l.byTenant, t)
		}
	}
}

func (e *entry) done() bool {
	select {
	case <-e.ready:
		return true
	default:
		return false
	}
}

// shared holds the process-wide Listers, by client.
var shared struct {
	mu sync.Mutex
	m  map[Client]*Lister
}

// Shared returns the process-wide Lister of client c with default options, making it on
// first use: every agent loop of a process that calls the same toolrunner client shares
// one list per tenant. A client whose type cannot be a map key gets a Lister of its own.
// nil for a nil c.
func Shared(c Client) *Lister {
	if c == nil {
		return nil
	}
	if !reflect.TypeOf(c).Comparable() {
		return New(c, Options{})
	}
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.m == nil {
		shared.m = map[Client]*Lister{}
	}
	l := shared.m[c]
	if l == nil {
		l = New(c, Options{})
		shared.m[c] = l
	}
	return l
}
