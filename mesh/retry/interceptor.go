package retry

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/md"
)

// Config configures the retry interceptors of one client connection (one target). The
// zero value retries with the default policy and budget.
type Config struct {
	// Target labels metrics and logs ("toolrunner", ...).
	Target string
	// Default is the policy of methods not in Methods.
	Default Policy
	// Methods maps a full method name to its policy.
	Methods map[string]Policy
	// Budget caps retries on this connection.
	Budget BudgetConfig
	// Throttle turns on client-side adaptive throttling.
	Throttle bool
	// Live, when set, replaces Default and Methods: every call takes its policy from
	// Live's current File (its policies for Target), so that a reload of --retry-config
	// changes the policies of connections already made. Budget and Throttle stay as
	// given: a budget's counts cannot be carried into a new one honestly.
	Live *Live
	// Window, when set, coordinates retries across replicas (issue 24, mesh/retrywindow):
	// before every retry (attempt 2 and later, never the first attempt) the call asks
	// Window for Target's retry window, and a refusal ends the call with the last
	// attempt's error marked RETRIES_EXHAUSTED, as if its retries were spent. nil: every
	// replica retries on its own, as before.
	Window Window
	// Metrics, if set, receives the retry metrics.
	Metrics *Metrics
	// Logger receives a record per retried attempt; slog.Default when nil.
	Logger *slog.Logger
	// StampIdentity also sends the context's identity and deadline (what md.AppendOutgoing
	// adds) on every attempt, in the same metadata append as the retry-id and attempt: the
	// mesh client chain sets it instead of stamping in a layer of its own.
	StampIdentity bool
	// Now, Rand and Sleep replace the clock, the random source and the wait, for tests.
	Now   func() time.Time
	Rand  func() float64
	Sleep func(context.Context, time.Duration) error
}

// Validate checks every policy and the budget.
func (c Config) Validate() error {
	if err := c.Default.Validate(); err != nil {
		return err
	}
	for m, p := range c.Methods {
		if err := p.Validate(); err != nil {
			return errorf("method %s: %v", m, err)
		}
	}
	return c.Budget.Validate()
}

// Window is a cluster-wide retry window (Config.Window): at most N replicas may retry
// calls to a target at a time. mesh/retrywindow implements it on the store's slots.
type Window interface {
	// AllowRetry returns nil when this process may retry a call to target now (it holds
	// the target's window, or has just claimed it), or an error saying why not (another
	// replica holds it; the store cannot be asked). It is called on the retry path only,
	// after the retry budget allowed the retry, and must return quickly when the
	// window is held.
	AllowRetry(ctx context.Context, target string) error
}

// WindowRefusal is implemented by a Window's refusal that knows when the window may be
// asked again (the held windows move, or the store is asked again). A retry refused so
// waits until then and asks again, at most MaxWindowWaits times, while the call's
// deadline leaves room for an attempt after the wait ("others wait", seed 001); any other
// refusal, or one the deadline leaves no room to wait for, ends the call.
type WindowRefusal interface {
	error
	RetryAt() time.Time
}

// MaxWindowWaits is how many refusals one retry waits out before it gives up.
const MaxWindowWaits = 3

// Metrics are the client-side retry metrics.
type Metrics struct {
	attempts        *prometheus.CounterVec
	backoff         *prometheus.HistogramVec
	budgetExhausted *prometheus.CounterVec
}

// NewMetrics creates the retry metrics and registers them with reg (if not nil).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_retry_attempts_total",
			Help: "Attempts of outgoing calls by target, method and the attempt's outcome code; attempt 2 and later are retries.",
		}, []string{"target", "method", "code", "retry"}),
		backoff: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "curfew_backoff_delay_seconds",
			Help:    "Delay slept before a retry (backoff with full jitter, or the server's pushback).",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"target", "method"}),
		budgetExhausted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_retry_budget_exhausted_total",
			Help: "Retries refused because the target's retry budget was spent.",
		}, []string{"target"}),
	}
	if reg != nil {
		reg.MustRegister(m.attempts, m.backoff, m.budgetExhausted)
	}
	return m
}

// Known exports the backoff series of target's methods (full names, /pkg.Service/Method)
// at 0 from the start, so that rate() and the alerts see 0 rather than nothing before
// the first retry.
func (m *Metrics) Known(target string, methods ...string) {
	for _, method := range methods {
		m.backoff.WithLabelValues(target, method)
	}
}

// client is the state shared by one connection's interceptors.
type client struct {
	cfg      Config
	budget   *Budget
	throttle *Throttle
	randMu   sync.Mutex
	rng      *rand.Rand

	live atomic.Pointer[livePolicies] // Config.Live's policies for Target, by File

	countersMu sync.RWMutex
	counters   map[attemptKey]prometheus.Counter // attempts, by labels looked up once
}

type attemptKey struct {
	method string
	code   codes.Code
	retry  bool
}

// attemptCounter returns the attempts counter of method, code and retry.
func (c *client) attemptCounter(m *Metrics, method string, code codes.Code, retry bool) prometheus.Counter {
	k := attemptKey{method, code, retry}
	c.countersMu.RLock()
	ctr := c.counters[k]
	c.countersMu.RUnlock()
	if ctr != nil {
		return ctr
	}
	ctr = m.attempts.WithLabelValues(c.cfg.Target, method, code.String(), strconv.FormatBool(retry))
	c.countersMu.Lock()
	if c.counters == nil {
		c.counters = map[attemptKey]prometheus.Counter{}
	}
	c.counters[k] = ctr
	c.countersMu.Unlock()
	return ctr
}

func newClient(cfg Config) *client {
	c := &client{cfg: cfg, budget: NewBudget(cfg.Budget, cfg.Now)}
	if m := cfg.Metrics; m != nil {
		// Export the target's budget series at 0 from the start, so that an alert on it
		// sees 0 rather than nothing.
		m.budgetExhausted.WithLabelValues(cfg.Target)
	}
	if cfg.Throttle {
		c.throttle = NewThrottle(0, cfg.Budget.WithDefaults().Window, cfg.Now)
	}
	if c.cfg.Now == nil {
		c.cfg.Now = time.Now
	}
	if c.cfg.Sleep == nil {
		c.cfg.Sleep = sleep
	}
	if c.cfg.Logger == nil {
		c.cfg.Logger = slog.Default()
	}
	if c.cfg.Rand == nil {
		c.rng = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())) //nolint:gosec // jitter, not secrets
		c.cfg.Rand = func() float64 {
			c.randMu.Lock()
			defer c.randMu.Unlock()
			return c.rng.Float64()
		}
	}
	return c
}

func (c *client) policy(method string) Policy {
	def, methods := c.cfg.Default, c.cfg.Methods
	if c.cfg.Live != nil {
		f := c.cfg.Live.Load()
		lp := c.live.Load()
		if lp == nil || lp.file != f {
			rc := f.For(c.cfg.Target)
			lp = &livePolicies{file: f, def: rc.Default, methods: rc.Methods}
			c.live.Store(lp)
		}
		def, methods = lp.def, lp.methods
	}
	if p, ok := methods[method]; ok {
		return p.WithDefaults()
	}
	return def.WithDefaults()
}

// Live is a retry File that a reload replaces (Config.Live). Its zero value is not
// usable: make it with NewLive. It is safe for concurrent use.
type Live struct{ f atomic.Pointer[File] }

// NewLive returns a Live holding f.
func NewLive(f *File) *Live {
	l := &Live{}
	l.f.Store(f)
	return l
}

// Load returns the current File.
func (l *Live) Load() *File { return l.f.Load() }

// Store replaces the current File: the next call of every connection using l takes its
// policy from f. Calls in flight keep the policy they started with.
func (l *Live) Store(f *File) { l.f.Store(f) }

// For is the current File's Config of target, with Live set to l.
func (l *Live) For(target string) Config {
	c := l.Load().For(target)
	c.Live = l
	return c
}

// livePolicies are one target's policies from one File, computed once per File.
type livePolicies struct {
	file    *File
	def     Policy
	methods map[string]Policy
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// call carries one logical call through its attempts.
type call struct {
	c        *client
	method   string
	p        Policy
	retryID  string
	hasKey   bool
	start    time.Time
	attempts int
	// first is the attempt number of this layer's first attempt: 1, or what the caller set
	// in curfew-attempt when it is itself retrying the same logical call.
	first int
	// callerAttempt: the caller set curfew-attempt, so each attempt replaces it. minted:
	// this layer minted the retry-id, so each attempt adds it.
	callerAttempt, minted bool
	// hedge: the call is a hedged call's backup (Hedge): one attempt, marked curfew-hedge.
	hedge bool
	// restartable: a stream may start over after its first message (Restartable), and
	// restarted is told when it does.
	restartable bool
	restarted   func(attempt int, err error)
	// note is the last attempt's endpoint note (endpoint.go), nil without a Window.
	note *endpointNote
}

// SideEffect marks one call as having side effects: it is retried only when it carries an
// idempotency key (curfew-idempotency-key), whatever its method's policy says.
func SideEffect() grpc.CallOption { return sideEffect{} }

type sideEffect struct{ grpc.EmptyCallOption }

// Restartable lets a server-streaming call start over after its first message when an
// attempt fails with an error the policy retries (its callee died, or drained past its
// grace, mid-call): the caller can take the stream again from its start. restarted, when
// not nil, is called on the receiving goroutine just before the next attempt is opened,
// with the number of the attempt that failed and its error, so that the caller drops what
// it built from the failed attempt's messages. Every rule of the policy still holds
// (attempts, budget, window, no retry of a side effect without an idempotency key), and
// the attempts share the call's retry-id, so the callee's in-flight table and idempotency
// records see one logical call. Without it (the default), a stream is never retried after
// its first message. Unary and client-streaming calls ignore it.
func Restartable(restarted func(attempt int, err error)) grpc.CallOption {
	return restartable{restarted: restarted}
}

type restartable struct {
	grpc.EmptyCallOption
	restarted func(attempt int, err error)
}

// Hedge marks one call as a hedged call's backup (package mesh/hedge): a second attempt of
// a logical call whose first attempt is still running, sent with its twin's retry-id
// (which the caller puts in curfew-retry-id). It draws on the connection's retry budget
// like a retry: when the budget would refuse a retry, the call fails at once, before
// anything is sent, with ErrHedgeRefused. Otherwise it is sent marked
// curfew-hedge: 1, does not count as a request of the budget (it is not a new logical
// call), and makes one attempt only: its twin is the call's other chance.
func Hedge() grpc.CallOption { return hedgeOpt{} }

type hedgeOpt struct{ grpc.EmptyCallOption }

// ErrHedgeRefused (RESOURCE_EXHAUSTED) is the refusal of a Hedge call that the retry
// budget would not allow: nothing was sent. Test for it with errors.Is.
var ErrHedgeRefused = status.Error(codes.ResourceExhausted, "hedge refused: the retry budget would refuse a retry")

func (c *client) begin(ctx context.Context, method string, opts []grpc.CallOption) (context.Context, *call, error) {
	// Single values are read, not a copy of the outgoing metadata.
	cl := &call{c: c, method: method, p: c.policy(method), start: c.cfg.Now(),
		hasKey: len(metadata.ValueFromOutgoingContext(ctx, md.IdempotencyKey)) > 0}
	for _, o := range opts {
		switch o := o.(type) {
		case sideEffect:
			cl.p.NonIdempotent = true
		case hedgeOpt:
			cl.hedge = true
		case restartable:
			cl.restartable, cl.restarted = true, o.restarted
		}
	}
	cl.first = 1
	if v := metadata.ValueFromOutgoingContext(ctx, md.Attempt); len(v) > 0 {
		cl.callerAttempt = true
		if a, err := strconv.Atoi(v[0]); err == nil && a > 1 {
			cl.first = a
		}
	}
	if id := outgoingID(ctx); id != "" {
		cl.retryID = id // the caller minted it (a retry at a higher level of the same call)
	} else {
		id, err := NewID()
		if err != nil {
			return nil, nil, err
		}
		cl.retryID, cl.minted = id, true // sent by attemptCtx
	}
	if cl.hedge {
		// A backup is an extra attempt of a call already counted: the budget's retry
		// allowance, not a request, and not the throttle's (its twin was). Its refusals
		// are counted by the hedging caller (curfew_hedges_refused_total), not as retries.
		if !c.budget.AllowRetry() {
			return nil, nil, ErrHedgeRefused
		}
		return ctx, cl, nil
	}
	if c.throttle != nil && !c.throttle.Allow(c.cfg.Rand()) {
		return nil, nil, status.Errorf(codes.Unavailable, "%s: throttled on the client: the target has been rejecting requests", method)
	}
	c.budget.Request()
	return ctx, cl, nil
}

// attemptCtx addresses this layer's attempt n (1-based), numbered on the wire from the
// caller's first attempt.
func (cl *call) attemptCtx(ctx context.Context, n int) context.Context {
	cl.attempts = n
	ctx = cl.noted(ctx)
	a := strconv.Itoa(cl.first + n - 1)
	if !cl.callerAttempt {
		// Appended to the call's context, not to the previous attempt's: one value each.
		var buf [12]string
		kv := buf[:0]
		if cl.c.cfg.StampIdentity {
			kv = md.AppendPairs(kv, ctx)
		}
		if cl.minted {
			kv = append(kv, md.RetryID, cl.retryID)
		}
		if cl.hedge {
			kv = append(kv, md.Hedge, md.HedgeBackup)
		}
		return metadata.AppendToOutgoingContext(ctx, append(kv, md.Attempt, a)...)
	}
	if cl.c.cfg.StampIdentity {
		ctx = md.AppendOutgoing(ctx)
	}
	out, _ := metadata.FromOutgoingContext(ctx) // a copy; Set replaces the caller's value
	out.Set(md.Attempt, a)
	if cl.minted {
		out.Append(md.RetryID, cl.retryID)
	}
	if cl.hedge {
		out.Set(md.Hedge, md.HedgeBackup)
	}
	return metadata.NewOutgoingContext(ctx, out)
}

// after judges attempt n's outcome and, to retry, waits before the next attempt. It
// returns retry, or the error to return (nil on success).
func (cl *call) after(ctx context.Context, n int, err error, trailer metadata.MD) (retry bool, out error) {
	return cl.judge(ctx, n, err, trailer, true)
}

// judge is after; count is false for an attempt already counted (a stream that answered,
// counted then, and failed afterwards): it is neither counted again in the attempts
// metric nor told to the throttle twice.
func (cl *call) judge(ctx context.Context, n int, err error, trailer metadata.MD, count bool) (retry bool, out error) {
	c := cl.c
	code := status.Code(err)
	if m := c.cfg.Metrics; m != nil && count {
		c.attemptCounter(m, cl.method, code, n > 1).Inc()
	}
	if c.throttle != nil && count && code != codes.Unavailable && code != codes.ResourceExhausted {
		c.throttle.Accepted()
	}
	if err == nil || ctx.Err() != nil || cl.hedge {
		return false, err // (a backup makes one attempt: its twin is the other)
	}
	left := time.Duration(1<<63 - 1)
	if dl, ok := ctx.Deadline(); ok {
		left = dl.Sub(c.cfg.Now())
	}
	d := cl.p.Decide(err, trailer, n, left, cl.hasKey, c.cfg.Rand)
	log := func(msg string, extra ...any) {
		id := md.IdentityFrom(ctx)
		c.cfg.Logger.InfoContext(ctx, msg, append([]any{"target", c.cfg.Target, "method", cl.method, "run_id", id.RunID, "node_id", id.NodeID,
			"retry_id", cl.retryID, "attempt", n, "error_type", code.String(), "elapsed_ms", c.cfg.Now().Sub(cl.start).Milliseconds(),
			"reason", d.Reason}, extra...)...)
	}
	switch d.Verdict {
	case GiveUp:
		return false, err
	case Exhausted:
		log("retries exhausted")
		if cl.p.Naive {
			return false, err
		}
		return false, MarkExhausted(err, n)
	case NoTime:
		log("no time left to retry", "backoff_ms", d.Delay.Milliseconds())
		return false, status.Errorf(codes.DeadlineExceeded, "no time left to retry %s after attempt %d (%s: %s): the wait of %v would end past the deadline",
			cl.method, n, code, status.Convert(err).Message(), d.Delay.Round(time.Millisecond))
	}
	if !c.budget.AllowRetry() {
		if m := c.cfg.Metrics; m != nil {
			m.budgetExhausted.WithLabelValues(c.cfg.Target).Inc()
		}
		log("retry budget exhausted")
		return false, MarkExhausted(err, n)
	}
	if out := cl.window(ctx, n, err, d.Delay, log); out != nil {
		return false, out
	}
	if m := c.cfg.Metrics; m != nil {
		m.backoff.WithLabelValues(c.cfg.Target, cl.method).Observe(d.Delay.Seconds())
	}
	log("retrying", "backoff_ms", d.Delay.Milliseconds())
	if serr := c.cfg.Sleep(ctx, d.Delay); serr != nil {
		return false, err // cancelled while backing off: the last attempt's error stands
	}
	// The window may have ended during the backoff: ask again (no store round trip
	// while it is still held).
	if out := cl.window(ctx, n, err, 0, log); out != nil {
		return false, out
	}
	return true, nil
}

// window asks Config.Window, if any, whether this replica may retry now, waiting out up
// to MaxWindowWaits refusals that say when to ask again (WindowRefusal) while the
// deadline leaves room for the wait, the backoff still to come and an attempt; a refusal
// it does not wait out returns attempt n's error marked exhausted, so that no layer
// above retries it either.
func (cl *call) window(ctx context.Context, n int, err error, backoff time.Duration, log func(string, ...any)) error {
	w := cl.c.cfg.Window
	if w == nil || cl.p.Naive {
		return nil // the naive baseline coordinates nothing, as it has no budget
	}
	if cl.endpointFailed() {
		log("retry needs no retry window: one replica of the target failed while another is up")
		return nil
	}
	for waits := 0; ; waits++ {
		werr := w.AllowRetry(ctx, cl.c.cfg.Target)
		if werr == nil {
			return nil
		}
		var wr WindowRefusal
		if waits < MaxWindowWaits && errors.As(werr, &wr) {
			now := cl.c.cfg.Now()
			d := wr.RetryAt().Sub(now)
			// A little jitter, so that the callers refused together do not all ask at
			// the same instant.
			d = max(d, 0) + time.Duration(cl.c.cfg.Rand()*float64(min(d/10, 100*time.Millisecond)+time.Millisecond))
			dl, ok := ctx.Deadline()
			if !ok || now.Add(d+backoff+cl.p.MinAttemptTime).Before(dl) {
				log("retry waits for a retry window", "window", werr.Error(), "wait_ms", d.Milliseconds())
				if serr := cl.c.cfg.Sleep(ctx, d); serr != nil {
					return err // cancelled while waiting: the last attempt's error stands
				}
				continue
			}
		}
		log("retry refused: no retry window", "window", werr.Error())
		return MarkExhausted(err, n)
	}
}

// UnaryClientInterceptor retries unary calls by cfg, with a budget of its own; use
// ClientInterceptors to share one budget between the unary and stream calls of a connection.
func UnaryClientInterceptor(cfg Config) grpc.UnaryClientInterceptor {
	return newClient(cfg).unary()
}

// ClientInterceptors returns the unary and the stream interceptor of one connection,
// sharing one budget (and throttle): the budget is per client and target, whatever the
// kind of call.
func ClientInterceptors(cfg Config) (grpc.UnaryClientInterceptor, grpc.StreamClientInterceptor) {
	c := newClient(cfg)
	return c.unary(), c.stream()
}

func (c *client) unary() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		ctx, cl, err := c.begin(ctx, method, opts)
		if err != nil {
			return err
		}
		for n := 1; ; n++ {
			var trailer metadata.MD
			err := invoker(cl.attemptCtx(ctx, n), method, req, reply, cc, append(opts, grpc.Trailer(&trailer))...)
			if retry, out := cl.after(ctx, n, err, trailer); !retry {
				return out
			}
		}
	}
}

// StreamClientInterceptor retries server-streaming calls by cfg, but only before the first
// response message: a model stream that has produced a token is never retried silently.
// Client-streaming calls are not retried. One per connection.
func StreamClientInterceptor(cfg Config) grpc.StreamClientInterceptor {
	return newClient(cfg).stream()
}

func (c *client) stream() grpc.StreamClientInterceptor {
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		ctx, cl, err := c.begin(ctx, method, opts)
		if err != nil {
			return nil, err
		}
		if desc.ClientStreams {
			return streamer(cl.attemptCtx(ctx, 1), desc, cc, method, opts...)
		}
		rs := &retryStream{ctx: ctx, cl: cl, desc: desc, cc: cc, method: method, streamer: streamer, opts: opts}
		for n := 1; ; n++ {
			cs, err := streamer(cl.attemptCtx(ctx, n), desc, cc, method, opts...)
			if err == nil {
				rs.cur, rs.n = cs, n
				return rs, nil
			}
			if retry, out := cl.after(ctx, n, err, nil); !retry {
				return nil, out
			}
		}
	}
}

// retryStream is a server-streaming call that can start over until its first message
// (after it too when the call is Restartable).
type retryStream struct {
	ctx      context.Context
	cl       *call
	desc     *grpc.StreamDesc
	cc       *grpc.ClientConn
	method   string
	streamer grpc.Streamer
	opts     []grpc.CallOption

	cur      grpc.ClientStream
	n        int
	sent     []any // the request, replayed on a new attempt
	closed   bool
	received bool // the current attempt has answered (it was counted)
	answered bool // some attempt has answered: the call's request is complete in sent
}

func (s *retryStream) Header() (metadata.MD, error) { return s.cur.Header() }
func (s *retryStream) Trailer() metadata.MD         { return s.cur.Trailer() }
func (s *retryStream) Context() context.Context     { return s.cur.Context() }

func (s *retryStream) CloseSend() error {
	s.closed = true
	return s.cur.CloseSend()
}

func (s *retryStream) SendMsg(m any) error {
	if !s.answered {
		s.sent = append(s.sent, m)
	}
	return s.cur.SendMsg(m)
}

func (s *retryStream) RecvMsg(m any) error {
	for {
		err := s.cur.RecvMsg(m)
		if err == nil || (!s.received && errors.Is(err, io.EOF)) {
			if !s.received {
				s.received, s.answered = true, true
				_, _ = s.cl.after(s.ctx, s.n, nil, nil) // count the attempt that answered
			}
			return err
		}
		if errors.Is(err, io.EOF) || (s.received && !s.cl.p.Naive && !s.cl.restartable) {
			// After the first message the work has been done and paid for (a token, a
			// subagent's first step): never retried silently. Only the naive baseline
			// does, and a Restartable call, whose caller takes the stream from its start.
			return err
		}
		// An attempt that answered was counted then (as OK): judged here, not recounted.
		retry, out := s.cl.judge(s.ctx, s.n, err, s.cur.Trailer(), !s.received)
		if !retry {
			return out
		}
		if s.received && s.cl.restarted != nil {
			s.cl.restarted(s.n, err)
		}
		s.received = false
		if err := s.restart(); err != nil {
			return err
		}
	}
}

// restart opens attempt n+1 and replays what was sent.
func (s *retryStream) restart() error {
	for {
		s.n++
		cs, err := s.streamer(s.cl.attemptCtx(s.ctx, s.n), s.desc, s.cc, s.method, s.opts...)
		if err != nil {
			retry, out := s.cl.after(s.ctx, s.n, err, nil)
			if !retry {
				return out
			}
			continue
		}
		s.cur = cs
		for _, m := range s.sent {
			if err := cs.SendMsg(m); err != nil && !errors.Is(err, io.EOF) {
				return err
			}
		}
		if s.closed {
			if err := cs.CloseSend(); err != nil {
				return err
			}
		}
		return nil
	}
}
