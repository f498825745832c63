package modelproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider"
)

// Fallback reasons recorded on a model node (meshv1.Fallback.reason).
const (
	ReasonBreakerOpen   = "breaker_open"
	ReasonUnavailable   = "unavailable"
	ReasonRateLimited   = "rate_limited"
	ReasonTimeout       = "timeout"
	ReasonServerError   = "server_error"
	ReasonShed          = "shed"
	ReasonInvalidOutput = "invalid_output"
)

// Router sends model calls to the configured providers: a model alias's fallback chain,
// each provider behind its own breaker, the degrade policy for schema-bound answers, the
// response cache and shedding by observed latency.
type Router struct {
	file      *File
	providers map[string]provider.Provider
	latency   map[string]*latency
	breakers  *breaker.Set
	cache     *Cache // nil when off
	shedQ     float64
	log       *slog.Logger
	m         *routerMetrics
}

type routerMetrics struct {
	fallbacks          *prometheus.CounterVec
	validationFailures *prometheus.CounterVec
	cacheHits          prometheus.Counter
	cacheMisses        prometheus.Counter
	tokensSaved        prometheus.Counter
	sheds              *prometheus.CounterVec
}

func newRouterMetrics(reg prometheus.Registerer) *routerMetrics {
	m := &routerMetrics{
		fallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "curfew_model_fallbacks_total",
			Help: "Model calls a provider of the alias's chain did not answer, by alias, provider and reason (breaker_open, unavailable, rate_limited, timeout, server_error, shed, invalid_output)."},
			[]string{"alias", "provider", "reason"}),
		validationFailures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "curfew_model_output_validation_failures_total",
			Help: "Answers that failed their response schema, by alias and provider; alert when it keeps rising (see docs/providers.md)."},
			[]string{"alias", "provider"}),
		cacheHits: prometheus.NewCounter(prometheus.CounterOpts{Name: "curfew_model_cache_hits_total",
			Help: "Model calls answered from the response cache."}),
		cacheMisses: prometheus.NewCounter(prometheus.CounterOpts{Name: "curfew_model_cache_misses_total",
			Help: "Cacheable model calls the response cache could not answer."}),
		tokensSaved: prometheus.NewCounter(prometheus.CounterOpts{Name: "curfew_model_cache_tokens_saved_total",
			Help: "Completion tokens the response cache answered without a provider decoding them."}),
		sheds: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "curfew_model_shed_total",
			Help: "Model calls refused before any upstream request because their time left could not cover the provider's expected latency, by alias."},
			[]string{"alias"}),
	}
	if reg != nil {
		reg.MustRegister(m.fallbacks, m.validationFailures, m.cacheHits, m.cacheMisses, m.tokensSaved, m.sheds)
	}
	return m
}

// RouterOptions wire a Router.
type RouterOptions struct {
	// Registry receives the router's and the provider breakers' metrics; may be nil.
	Registry prometheus.Registerer
	Log      *slog.Logger
	// Getenv reads API keys named by api_key_env; os.Getenv when nil.
	Getenv func(string) string
	// Providers, when set, replaces the OpenAI-compatible client built for a provider
	// name (tests inject a different transport this way).
	Providers map[string]provider.Provider
}

// NewRouter builds the providers of f (validated) and their breakers.
func NewRouter(f *File, o RouterOptions) (*Router, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Getenv == nil {
		o.Getenv = os.Getenv
	}
	r := &Router{file: f, providers: map[string]provider.Provider{}, latency: map[string]*latency{},
		shedQ: DefaultShedQuantile, log: o.Log, m: newRouterMetrics(o.Registry)}
	for _, pc := range f.Providers {
		r.latency[pc.Name] = newLatency(time.Duration(pc.TTFT), pc.TokensPerSecond)
		if p, ok := o.Providers[pc.Name]; ok {
			r.providers[pc.Name] = p
			continue
		}
		key, err := pc.APIKey(o.Getenv)
		if err != nil {
			return nil, err
		}
		p, err := provider.NewOpenAI(provider.OpenAIConfig{Name: pc.Name, BaseURL: pc.BaseURL, APIKey: key, Timeout: time.Duration(pc.Timeout)})
		if err != nil {
			return nil, fmt.Errorf("provider %q: %w", pc.Name, err)
		}
		r.providers[pc.Name] = p
	}
	r.breakers = breaker.NewSet(f.BreakerSettings(), o.Registry)
	r.breakers.SetLogger(o.Log)
	// The providers are known: their breakers' series start at 0, before the first call.
	for name := range r.providers {
		r.breakers.Get(name)
	}
	if c := f.Cache; c == nil || !c.Off {
		ttl, n := DefaultCacheTTL, DefaultCacheMaxEntries
		if c != nil && c.TTL > 0 {
			ttl = time.Duration(c.TTL)
		}
		if c != nil && c.MaxEntries > 0 {
			n = c.MaxEntries
		}
		r.cache = NewCache(n, ttl)
	}
	if s := f.Shed; s != nil {
		if s.Off {
			r.shedQ = -1
		} else if s.Quantile > 0 {
			r.shedQ = s.Quantile
		}
	}
	r.m.init(f)
	return r, nil
}

// fallbackReasons are every Reason*, for init.
var fallbackReasons = []string{ReasonBreakerOpen, ReasonUnavailable, ReasonRateLimited, ReasonTimeout, ReasonServerError, ReasonShed, ReasonInvalidOutput}

// init makes the series of every configured alias and provider of its chain exist at 0,
// so that rate() and the alerting rules see 0 rather than nothing before the first event.
// Their number is bounded by the file: aliases × chain targets × reasons.
func (m *routerMetrics) init(f *File) {
	for alias, a := range f.Models {
		m.sheds.WithLabelValues(alias)
		targets := a.Chain
		if a.DegradeTo != "" {
			targets = append(targets[:len(targets):len(targets)], a.DegradeTo)
		}
		for _, s := range targets {
			t, err := ParseTarget(s)
			if err != nil {
				continue // validated
			}
			m.validationFailures.WithLabelValues(alias, t.Provider)
			for _, reason := range fallbackReasons {
				m.fallbacks.WithLabelValues(alias, t.Provider, reason)
			}
		}
	}
}

// Close releases the providers' idle upstream connections.
func (r *Router) Close() {
	for _, p := range r.providers {
		if c, ok := p.(interface{ CloseIdleConnections() }); ok {
			c.CloseIdleConnections()
		}
	}
}

// Breaker returns the breaker of a provider (for tests and the admin view).
func (r *Router) Breaker(providerName string) *breaker.Breaker { return r.breakers.Get(providerName) }

// Breakers returns the set of the provider breakers (to coordinate them across
// replicas, breaker.Set.Coordinate).
func (r *Router) Breakers() *breaker.Set { return r.breakers }

// Models returns the aliases and the provider/model names the router serves.
func (r *Router) Models() []string {
	var out []string
	for a := range r.file.Models {
		out = append(out, a)
	}
	for _, p := range r.file.Providers {
		for _, m := range p.Models {
			out = append(out, p.Name+"/"+m)
		}
	}
	return out
}

// Aliases returns the aliases of the providers file, each with the first target of its
// chain (the one that answers while healthy).
func (r *Router) Aliases() map[string]Target {
	out := make(map[string]Target, len(r.file.Models))
	for a, cfg := range r.file.Models {
		var first Target
		if len(cfg.Chain) > 0 {
			first, _ = ParseTarget(cfg.Chain[0]) // validated
		}
		out[a] = first
	}
	return out
}

// chainRoute is a model name the router resolved: its fallback chain.
type chainRoute struct {
	r       *Router
	alias   string // the alias, or the provider/model asked for
	chain   []Target
	degrade *Target
	cfg     *AliasConfig // nil for a direct provider/model
}

// resolve maps a model name to its route; ok is false for a name the router does not know.
func (r *Router) resolve(model string) (*chainRoute, bool) {
	if a, ok := r.file.Models[model]; ok {
		rt := &chainRoute{r: r, alias: model, cfg: &a}
		for _, s := range a.Chain {
			t, _ := ParseTarget(s) // validated
			rt.chain = append(rt.chain, t)
		}
		if a.DegradeTo != "" {
			t, _ := ParseTarget(a.DegradeTo)
			rt.degrade = &t
		}
		return rt, true
	}
	t, err := ParseTarget(model)
	if err != nil {
		return nil, false
	}
	for _, p := range r.file.Providers {
		if p.Name == t.Provider {
			for _, m := range p.Models {
				if m == t.Model {
					return &chainRoute{r: r, alias: model, chain: []Target{t}}, true
				}
			}
		}
	}
	return nil, false
}

// chainCall is one model call being routed.
type chainCall struct {
	*call
	r      *Router
	rt     *chainRoute
	schema *jsonschema.Schema
	// fallbacks so far, recorded on the node
	fallbacks []*meshv1.Fallback
}

// provider is the provider that served the call, as recorded on its node.
func (rt *chainRoute) provider(ended *meshv1.Node) string { return ended.GetProvider() }

// serve answers the call through the route. It returns a gRPC status error.
func (rt *chainRoute) serve(ctx context.Context, cl *call) error {
	r, req := rt.r, cl.req
	c := &chainCall{call: cl, r: r, rt: rt}
	if sc := req.GetResponseSchema(); sc != nil {
		sch, err := compileSchema(sc.GetSchemaJson())
		if err != nil {
			return status.Errorf(codes.InvalidArgument, "response_schema: %v", err)
		}
		c.schema = sch
	}
	var key [32]byte
	useCache := r.cache != nil && cacheable(req, rt.cfg)
	if useCache {
		k, err := cacheKey(req)
		if err != nil {
			return status.Errorf(codes.Internal, "cache key: %v", err)
		}
		key = k
		if hit, ok := r.cache.get(key); ok {
			r.m.cacheHits.Inc()
			r.m.tokensSaved.Add(float64(hit.usage.GetCompletionTokens()))
			return c.sendCached(hit)
		}
		r.m.cacheMisses.Inc()
	}
	ans, err := c.chain(ctx)
	if err != nil {
		return err
	}
	if useCache {
		r.cache.put(key, ans)
	}
	return nil
}

// chain tries the route's targets in order, then the degrade target if the answer failed
// its schema.
func (c *chainCall) chain(ctx context.Context) (*cached, error) {
	var lastErr error
	for _, t := range c.rt.chain {
		ans, reason, err := c.try(ctx, t)
		if err == nil {
			return ans, nil
		}
		if reason == "" { // not the provider's trouble: a client error, a cancel, a partial answer
			return nil, err
		}
		c.fellBack(t, reason, err)
		lastErr = err
		if reason == ReasonInvalidOutput {
			if c.rt.degrade == nil {
				return nil, err
			}
			ans, reason, err := c.try(ctx, *c.rt.degrade)
			if err != nil && reason != "" {
				c.fellBack(*c.rt.degrade, reason, err)
			}
			return ans, err
		}
	}
	return nil, c.exhausted(lastErr)
}

// exhausted is the error when every target of the chain failed.
func (c *chainCall) exhausted(last error) error {
	parts := make([]string, 0, len(c.fallbacks))
	allShed := true
	for _, f := range c.fallbacks {
		parts = append(parts, f.GetProvider()+": "+f.GetReason())
		allShed = allShed && f.GetReason() == ReasonShed
	}
	if allShed {
		c.r.m.sheds.WithLabelValues(c.rt.alias).Inc()
		return status.Errorf(codes.DeadlineExceeded, "model %q: the time left cannot cover any provider's expected latency (%s)", c.rt.alias, strings.Join(parts, "; "))
	}
	st := status.New(codes.Unavailable, fmt.Sprintf("model %q: no provider answered (%s)", c.rt.alias, strings.Join(parts, "; ")))
	// Said as a dependency's trouble, not modelproxy's: a caller's breaker on modelproxy
	// must not fence off every other model for one alias's providers (breaker.Classify).
	if ws, err := st.WithDetails(&errdetails.ErrorInfo{Reason: ReasonProvidersUnavailable, Domain: "curfew.dev",
		Metadata: map[string]string{"model": c.rt.alias}}); err == nil {
		st = ws
	}
	// Keep the last provider's pushback, if any, so the caller's retry waits as asked.
	if s, ok := status.FromError(last); ok {
		for _, d := range s.Details() {
			if ri, ok := d.(*errdetails.RetryInfo); ok {
				if ws, err := st.WithDetails(ri); err == nil {
					st = ws
				}
			}
		}
	}
	return st.Err()
}

func (c *chainCall) fellBack(t Target, reason string, err error) {
	f := &meshv1.Fallback{Provider: t.Provider, Model: t.Model, Reason: reason}
	if s, ok := status.FromError(err); ok && err != nil {
		f.ErrorCode, f.ErrorMessage = nodes.CodeName(s.Code()), s.Message()
	}
	c.fallbacks = append(c.fallbacks, f)
	c.r.m.fallbacks.WithLabelValues(c.rt.alias, t.Provider, reason).Inc()
	c.r.log.Warn("model fallback", "alias", c.rt.alias, "provider", t.Provider, "model", t.Model, "reason", reason,
		"error", f.ErrorMessage, "run_id", c.run, "node_id", c.node)
	fs := c.fallbacks
	c.nodes.Update(c.run, c.node, func(n *meshv1.Node) { n.Fallbacks = fs })
}

// try calls one target. On failure, reason says why when the provider is at fault (and
// the chain may fall back); an empty reason means the error goes to the caller as is.
func (c *chainCall) try(ctx context.Context, t Target) (_ *cached, reason string, _ error) {
	lat := c.r.latency[t.Provider]
	if c.r.shedQ > 0 {
		if dl, ok := ctx.Deadline(); ok {
			ttft, per := lat.expected(c.r.shedQ)
			need := ttft + time.Duration(c.req.GetMaxTokens())*per
			if left := time.Until(dl); need > 0 && left < need {
				return nil, ReasonShed, status.Errorf(codes.DeadlineExceeded, "%s: %v left, expected %v (first token %v + %d tokens at %v)",
					t, left.Round(time.Millisecond), need.Round(time.Millisecond), ttft.Round(time.Millisecond), c.req.GetMaxTokens(), per)
			}
		}
	}
	b := c.r.breakers.Get(t.Provider)
	done, err := b.Allow(ctx)
	if err != nil {
		return nil, ReasonBreakerOpen, err
	}
	ans, forwarded, err := c.stream1(ctx, t, lat)
	done(err)
	if err == nil {
		return ans, "", nil
	}
	if forwarded || ctx.Err() != nil {
		return nil, "", err
	}
	return nil, fallbackReason(err), err
}

// fallbackReason classifies a provider error: a reason when the chain should try the next
// provider, "" when the error is the caller's.
func fallbackReason(err error) string {
	s, _ := status.FromError(err)
	reason, _ := provider.ErrorReason(err)
	switch {
	case reason == invalidOutputReason:
		return ReasonInvalidOutput
	case s.Code() == codes.ResourceExhausted:
		return ReasonRateLimited
	case s.Code() == codes.DeadlineExceeded && reason == provider.ReasonTimeout:
		return ReasonTimeout
	case s.Code() == codes.Unavailable && reason == provider.ReasonServerError:
		return ReasonServerError
	case s.Code() == codes.Unavailable:
		return ReasonUnavailable
	case s.Code() == codes.Internal || s.Code() == codes.Unknown:
		return ReasonServerError
	}
	return ""
}

// ReasonProvidersUnavailable is the ErrorInfo reason of a call no provider of the chain
// answered.
const ReasonProvidersUnavailable = "PROVIDERS_UNAVAILABLE"

// invalidOutputReason is the ErrorInfo reason of an answer that failed its schema.
const invalidOutputReason = "INVALID_MODEL_OUTPUT"

// stream1 streams one provider's answer to the caller. A schema-bound answer is held back
// until it validates. forwarded reports whether any chunk reached the caller (after which
// no other provider may answer instead).
func (c *chainCall) stream1(ctx context.Context, t Target, lat *latency) (_ *cached, forwarded bool, _ error) {
	p := c.r.providers[t.Provider]
	start := time.Now()
	c.nodes.Update(c.run, c.node, func(n *meshv1.Node) { n.Provider, n.ServedModel = t.Provider, t.Model })
	pr := providerRequest(t.Model, c.req)
	if pr.MaxTokens <= 0 && c.maxTokens > 0 {
		pr.MaxTokens = int(c.maxTokens)
	}
	st, err := p.Stream(ctx, pr)
	if err != nil {
		return nil, false, err
	}
	defer func() { _ = st.Close() }()
	var (
		text        strings.Builder
		counted     int64
		first, last time.Time
		final       *provider.Chunk
		hold        = c.schema != nil
		pending     []*modelproxyv1.GenerateResponse
	)
	for {
		ch, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, forwarded, err
		}
		now := time.Now()
		if ch.Tokens > 0 {
			if first.IsZero() {
				first = now
			}
			last = now
			counted += int64(ch.Tokens)
			c.spend.record(now, ch.Tokens, t.Provider)
			c.metrics.addTokens(c.rt.alias, t.Provider, ch.Tokens)
		}
		if ch.FinishReason != "" || ch.Usage != nil || len(ch.ToolCalls) > 0 {
			final = ch
		}
		if ch.Delta == "" && ch.Tokens == 0 {
			continue
		}
		text.WriteString(ch.Delta)
		msg := &modelproxyv1.GenerateResponse{Delta: ch.Delta, Tokens: int32(ch.Tokens)} //nolint:gosec // a chunk's tokens, at most one completion's: far below 2^31
		if hold {
			pending = append(pending, msg)
			continue
		}
		if err := c.stream.Send(msg); err != nil {
			return nil, true, err
		}
		forwarded = true
	}
	if final == nil {
		final = &provider.Chunk{FinishReason: "stop"}
	}
	usage := final.Usage
	if usage == nil {
		usage = &modelproxyv1.Usage{CompletionTokens: counted}
	} else if extra := usage.GetCompletionTokens() - counted; extra > 0 {
		// The provider's count is authoritative; record what the stream did not show.
		c.spend.record(time.Now(), int(extra), t.Provider)
		c.metrics.addTokens(c.rt.alias, t.Provider, int(extra))
	}
	if p := usage.GetPromptTokens(); p > 0 {
		c.spend.prompt(p)
		c.metrics.addPrompt(c.rt.alias, t.Provider, p)
	}
	if !first.IsZero() {
		lat.observe(first.Sub(start), int(counted), last.Sub(first))
	}
	if c.schema != nil && len(final.ToolCalls) == 0 {
		if verr := validate(c.schema, text.String()); verr != nil {
			c.r.m.validationFailures.WithLabelValues(c.rt.alias, t.Provider).Inc()
			st := status.New(codes.FailedPrecondition, fmt.Sprintf("%s: the answer does not satisfy the response schema: %v", t, verr))
			if ws, err := st.WithDetails(&errdetails.ErrorInfo{Reason: invalidOutputReason, Domain: provider.ErrorDomain,
				Metadata: map[string]string{"provider": t.Provider, "model": t.Model}}); err == nil {
				st = ws
			}
			return nil, false, st.Err()
		}
	}
	for _, m := range pending {
		if err := c.stream.Send(m); err != nil {
			return nil, true, err
		}
	}
	ans := &cached{text: text.String(), toolCalls: final.ToolCalls, finishReason: final.FinishReason, usage: usage, provider: t.Provider, model: t.Model}
	fs := c.fallbacks
	c.nodes.Update(c.run, c.node, func(n *meshv1.Node) { n.Provider, n.ServedModel, n.Fallbacks = t.Provider, t.Model, fs })
	if err := c.stream.Send(&modelproxyv1.GenerateResponse{ToolCalls: ans.toolCalls, FinishReason: ans.finishReason, Usage: usage,
		Provider: t.Provider, ServedModel: t.Model}); err != nil {
		return nil, true, err
	}
	return ans, true, nil
}

// sendCached answers from the cache: the text in one chunk, no tokens spent.
func (c *chainCall) sendCached(a *cached) error {
	c.nodes.Update(c.run, c.node, func(n *meshv1.Node) { n.Provider, n.ServedModel, n.Cached = a.provider, a.model, true })
	if a.text != "" {
		if err := c.stream.Send(&modelproxyv1.GenerateResponse{Delta: a.text}); err != nil {
			return err
		}
	}
	return c.stream.Send(&modelproxyv1.GenerateResponse{ToolCalls: a.toolCalls, FinishReason: a.finishReason,
		Usage: &modelproxyv1.Usage{PromptTokens: 0, CompletionTokens: 0}, Provider: a.provider, ServedModel: a.model, Cached: true})
}

func compileSchema(s string) (*jsonschema.Schema, error) {
	doc, err := jsonschema.UnmarshalJSON(strings.NewReader(s))
	if err != nil {
		return nil, fmt.Errorf("not JSON: %w", err)
	}
	comp := jsonschema.NewCompiler()
	if err := comp.AddResource("response.json", doc); err != nil {
		return nil, err
	}
	return comp.Compile("response.json")
}

// validate checks an answer against its schema.
func validate(sch *jsonschema.Schema, answer string) error {
	v, err := jsonschema.UnmarshalJSON(strings.NewReader(strings.TrimSpace(answer)))
	if err != nil {
		return fmt.Errorf("not JSON: %w", err)
	}
	if err := sch.Validate(v); err != nil {
		return errors.New(strings.ReplaceAll(err.Error(), "\n", " "))
	}
	return nil
}
