package budget

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// Defaults of a Shared.
const (
	// DefaultTTL is how long a reservation outlives its holder's last renewal: a
	// crashed replica's reservations stop counting this long after its death.
	DefaultTTL = 10 * time.Second
	// DefaultStoreTimeout bounds each store call of a reservation or settlement; a call
	// that takes longer counts as the store being unreachable.
	DefaultStoreTimeout = 2 * time.Second
	// probeEvery is how often a degraded Shared tries the store again.
	probeEvery = time.Second
	// replicasEvery is how often the number of live replicas is asked for.
	replicasEvery = 30 * time.Second
	// maxPending bounds the settlements kept while the store is unreachable.
	maxPending = 100_000
)

// ErrClosed is returned by Reserve once the Shared was closed.
var ErrClosed = errors.New("budget: closed")

// SharedConfig configures a Shared.
type SharedConfig struct {
	// Store holds the reservations (required): every replica sharing it shares the
	// budgets.
	Store store.Budgets
	// Limits gives each tenant's TokenBudget and Window, asked for at every
	// reservation (required; an admission.Config or admission.LiveLimits).
	Limits admission.LimitSource
	// Name names this process's holder in the store: unique among live processes and
	// never reused by a later one. Default: hostname-pid-random.
	Name string
	// TTL is how long a reservation outlives the last renewal (default DefaultTTL);
	// renewals run every TTL/3.
	TTL time.Duration
	// StoreTimeout bounds each store call (default DefaultStoreTimeout).
	StoreTimeout time.Duration
	// Replicas, if set, returns how many replicas share the budgets now (this one
	// included). It sizes this replica's share while the store is unreachable (the
	// remaining budget / replicas); nil, an error or a count below 1 is 1.
	Replicas func(ctx context.Context) (int, error)
	// Registry receives the metrics (see Shared); nil registers nothing.
	Registry prometheus.Registerer
	// Now is the clock of the degraded mode's local accounting; nil is time.Now. The
	// store judges its windows and TTLs by its own clock (store.WithClock).
	Now func() time.Time
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// Shared is Budgets reserved in the store, so that every replica sharing it enforces a
// tenant's budget together (docs/cluster.md, "Budgets across replicas"). A reservation
// costs one store round trip, a settlement one; the holds this process has in flight
// are renewed every TTL/3 in one statement whatever their number (none while it holds
// nothing).
//
// When the store cannot be reached (a reservation, settlement or renewal fails) it is
// degraded: reservations are judged in this process alone, against its share of what
// the tenant had left when the store last answered (the remaining budget / replicas;
// the whole budget / replicas in a window it had not seen), settlements are kept and
// charged to the store when it is back, and the store is tried again every second; the
// first success ends the degraded mode. Metrics: curfew_model_budget_refusals_total
// and curfew_model_budget_reserved_tokens (as Memory's),
// curfew_budget_coordination_degraded (1 while degraded) and
// curfew_budget_holds_lost_total (reservations that expired in the store while their
// call was running: a renewal came back without them).
type Shared struct {
	st      store.Budgets
	limits  admission.LimitSource
	name    string
	ttl     time.Duration
	timeout time.Duration
	peers   func(ctx context.Context) (int, error)
	now     func() time.Time
	log     *slog.Logger

	ctx  context.Context // ends at Close: the loop's context
	stop context.CancelFunc
	wg   sync.WaitGroup

	mu       sync.Mutex
	closed   bool
	seq      uint64
	holds    map[string]*sharedHold // in the store: renewed until settled
	pending  []store.TokenSettlement
	known    map[string]known // what the store last said of each tenant
	replicas int
	// replicasAt is when replicas was last asked for (the loop's).
	replicasAt time.Time
	degraded   *Memory // the local accounting while the store is unreachable; nil otherwise
	degradedAt time.Time

	refusals prometheus.Counter
	reserved prometheus.Gauge
	degGauge prometheus.Gauge
	lost     prometheus.Counter
}

// known is a tenant's state when the store last answered for it.
type known struct {
	window time.Duration
	start  time.Time
	used   int64 // spent + reserved
}

// NewShared returns Budgets on cfg.Store and starts its renewal loop; Close stops it.
func NewShared(cfg SharedConfig) (*Shared, error) {
	if cfg.Store == nil || cfg.Limits == nil {
		return nil, errors.New("budget: a Shared needs a store and limits")
	}
	if cfg.Name == "" {
		cfg.Name = holderName()
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.StoreTimeout <= 0 {
		cfg.StoreTimeout = DefaultStoreTimeout
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Shared{st: cfg.Store, limits: cfg.Limits, name: cfg.Name, ttl: cfg.TTL, timeout: cfg.StoreTimeout,
		peers: cfg.Replicas, now: cfg.Now, log: cfg.Logger,
		holds: map[string]*sharedHold{}, known: map[string]known{}, replicas: 1,
		refusals: prometheus.NewCounter(prometheus.CounterOpts{Name: "curfew_model_budget_refusals_total",
			Help: "Model calls refused before they started because their tenant's token budget could not cover their reservation (prompt + max_tokens)."}),
		reserved: prometheus.NewGauge(prometheus.GaugeOpts{Name: "curfew_model_budget_reserved_tokens",
			Help: "Tokens reserved against tenants' budgets by model calls in flight."}),
		degGauge: prometheus.NewGauge(prometheus.GaugeOpts{Name: "curfew_budget_coordination_degraded",
			Help: "1 while the store holding the cluster's token budgets is unreachable and this replica judges reservations alone, against its share of what each tenant had left."}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{Name: "curfew_budget_holds_lost_total",
			Help: "Token reservations that expired in the store while their model call was running (renewals failed for longer than the TTL); the call's spend is still charged."}),
	}
	if cfg.Registry != nil {
		cfg.Registry.MustRegister(s.refusals, s.reserved, s.degGauge, s.lost)
	}
	s.ctx, s.stop = context.WithCancel(context.Background())
	s.refreshReplicas(s.ctx)
	// Asked again at the first tick: replicas starting together have written their rows
	// of store.Replicas by then.
	s.replicasAt = time.Time{}
	s.wg.Add(1)
	go s.loop()
	return s, nil
}

// holderName is unique to this process: a restarted one never inherits a dead one's
// holds.
func holderName() string {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return host + "-" + strconv.Itoa(os.Getpid()) + "-" + hex.EncodeToString(b[:])
}

// Name is the holder's name in the store.
func (s *Shared) Name() string { return s.name }

// Degraded reports whether the store is unreachable and reservations are judged
// locally.
func (s *Shared) Degraded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.degraded != nil
}

// SharedStatus is a Shared's coordination as Status reports it.
type SharedStatus struct {
	// Degraded: the store is unreachable and reservations are judged against this
	// replica's share, since DegradedSince.
	Degraded      bool
	DegradedSince time.Time
	// Replicas is the replica count the share is computed from (the last count).
	Replicas int
	// Pending is the settlements kept in memory to be charged to the store.
	Pending int
}

// Status reports the coordination's state.
func (s *Shared) Status() SharedStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := SharedStatus{Degraded: s.degraded != nil, Replicas: s.replicas, Pending: len(s.pending)}
	if st.Degraded {
		st.DegradedSince = s.degradedAt
	}
	return st
}

func (s *Shared) limitsOf(name string) (int64, time.Duration) {
	l := s.limits.TenantLimits(name)
	if l.Window <= 0 {
		l.Window = admission.DefaultBudgetWindow
	}
	return l.TokenBudget, l.Window
}

// Reserve implements Budgets: one store round trip, or none while degraded. The ledger
// name of ctx (WithLedger), if any, goes with the hold: a hold this process never
// settles is charged the call's ledger spend when it lapses.
func (s *Shared) Reserve(ctx context.Context, name string, n int64) (Hold, error) {
	budget, window := s.limitsOf(name)
	if budget <= 0 {
		return NoHold, nil
	}
	n = max(n, 1)
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	local := s.degraded
	s.seq++
	seq := s.seq
	s.mu.Unlock()
	if local == nil {
		id := s.name + "/" + strconv.FormatUint(seq, 10)
		ref := ledgerOf(ctx) // what the hold is charged if it lapses
		sctx, cancel := context.WithTimeout(ctx, s.timeout)
		st, err := s.st.ReserveTokens(sctx, store.TokenReservation{Tenant: name, Holder: s.name, ID: id,
			RunID: ref.run, LedgerKey: ref.key, Tokens: n, Budget: budget, Window: window, TTL: s.ttl})
		cancel()
		if err == nil {
			return s.granted(name, id, seq, n, budget, window, st)
		}
		if ctx.Err() != nil { // the caller's end, not the store's
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		if errors.Is(err, store.ErrInvalidArgument) { // the request's fault, not the store's
			return nil, status.Error(codes.InvalidArgument, err.Error())
		}
		local = s.degrade(err)
	}
	return s.reserveLocal(ctx, local, name, n)
}

// granted turns the store's answer into a Hold or a Refusal.
func (s *Shared) granted(name, id string, seq uint64, n, budget int64, window time.Duration, st store.TokenBudgetState) (Hold, error) {
	s.mu.Lock()
	s.known[name] = known{window: window, start: st.WindowStart, used: st.Spent + st.Reserved}
	if st.Granted {
		h := &sharedHold{s: s, tenant: name, id: id, seq: seq, n: n, window: window}
		s.holds[id] = h
		s.mu.Unlock()
		s.reserved.Add(float64(n))
		return h, nil
	}
	s.mu.Unlock()
	s.refusals.Inc()
	return nil, &Refusal{Tenant: name, Spent: st.Spent, Reserved: st.Reserved, Budget: budget, Window: window, Need: n,
		WindowEnd: st.WindowStart.Add(window)}
}

// reserveLocal reserves against this replica's share (degraded mode).
func (s *Shared) reserveLocal(ctx context.Context, local *Memory, name string, n int64) (Hold, error) {
	budget, window := s.limitsOf(name)
	if share, used := local.limits.(shareSource).share(name, budget, window); share < 1 {
		s.refusals.Inc()
		return nil, &Refusal{Tenant: name, Spent: used, Budget: budget, Window: window, Need: n,
			WindowEnd: windowStart(s.now(), window).Add(window)}
	}
	h, err := local.Reserve(ctx, name, n)
	if err != nil {
		if Refused(err) {
			s.refusals.Inc()
		}
		return nil, err
	}
	s.reserved.Add(float64(n))
	return &localHold{s: s, h: h, tenant: name, n: n, window: window}, nil
}

// degrade enters the degraded mode (if not in it) after err, and returns its local
// accounting.
func (s *Shared) degrade(err error) *Memory {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.degraded == nil {
		snap := make(map[string]known, len(s.known))
		for k, v := range s.known {
			snap[k] = v
		}
		s.degraded = NewMemory(shareSource{s: s, known: snap, replicas: s.replicas}, Options{Now: s.now})
		s.degradedAt = time.Now()
		s.degGauge.Set(1)
		s.log.Warn("token budgets: the store is unreachable; reserving against this replica's share until it is back",
			"replicas", s.replicas, "error", err.Error())
	}
	return s.degraded
}

// resume leaves the degraded mode.
func (s *Shared) resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.degraded != nil {
		s.degraded = nil
		s.degGauge.Set(0)
		s.log.Info("token budgets: the store is back; reservations are coordinated again", "pending", len(s.pending))
	}
}

// shareSource gives the degraded mode's limits: each tenant's share of what it had
// left when the store last answered, in the same window, or of its whole budget.
type shareSource struct {
	s        *Shared
	known    map[string]known
	replicas int
}

func (src shareSource) TenantLimits(name string) admission.TenantLimits {
	budget, window := src.s.limitsOf(name)
	if budget <= 0 {
		return admission.TenantLimits{}
	}
	// At least 1, since 0 would mean no budget: reserveLocal refuses a share below 1
	// itself.
	share, _ := src.share(name, budget, window)
	return admission.TenantLimits{TokenBudget: max(share, 1), Window: window}
}

// share is this replica's share of what name has left in its current window, and what
// the store last said was used of it (spent + reserved; 0 in a window it had not seen).
func (src shareSource) share(name string, budget int64, window time.Duration) (share, used int64) {
	if k, ok := src.known[name]; ok && k.window == window && !k.start.Before(windowStart(src.s.now(), window)) {
		used = k.used
	}
	return (budget - used) / int64(max(src.replicas, 1)), used
}

// sharedHold is a reservation held in the store.
type sharedHold struct {
	s        *Shared
	tenant   string
	id       string
	seq      uint64
	n        int64
	window   time.Duration
	settling atomic.Bool
	once     sync.Once
}

// Settle implements Hold: one store round trip, or a settlement kept for later when
// the store is unreachable (the hold is renewed meanwhile, so it keeps counting).
func (h *sharedHold) Settle(actual int64) {
	h.once.Do(func() {
		h.settling.Store(true)
		s := h.s
		s.reserved.Sub(float64(h.n))
		c := store.TokenSettlement{Tenant: h.tenant, ID: h.id, Actual: max(actual, 0), Window: h.window, At: s.now()}
		if !s.Degraded() {
			ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
			err := s.st.SettleTokens(ctx, c)
			cancel()
			if err == nil {
				s.mu.Lock()
				delete(s.holds, h.id)
				s.mu.Unlock()
				return
			}
			s.degrade(err)
		}
		s.keep(c)
	})
}

// localHold is a reservation made while degraded.
type localHold struct {
	s      *Shared
	h      Hold
	tenant string
	n      int64
	window time.Duration
	once   sync.Once
}

// Settle implements Hold: settled locally, and charged to the store when it is back.
func (h *localHold) Settle(actual int64) {
	h.once.Do(func() {
		h.h.Settle(actual)
		h.s.reserved.Sub(float64(h.n))
		h.s.keep(store.TokenSettlement{Tenant: h.tenant, Actual: max(actual, 0), Window: h.window, At: h.s.now()})
	})
}

// keep queues a settlement for the store.
func (s *Shared) keep(c store.TokenSettlement) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.pending) >= maxPending {
		s.log.Error("token budgets: too many settlements kept for the store; dropping the oldest", "tenant", s.pending[0].Tenant)
		s.pending = s.pending[1:]
	}
	s.pending = append(s.pending, c)
}

// loop renews the holds every TTL/3 (every second while degraded, as the probe), and
// flushes the kept settlements.
func (s *Shared) loop() {
	defer s.wg.Done()
	t := time.NewTimer(s.interval())
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		s.tick(s.ctx)
		t.Reset(s.interval())
	}
}

func (s *Shared) interval() time.Duration {
	if s.Degraded() {
		return min(probeEvery, s.ttl/3)
	}
	return s.ttl / 3
}

// tick is one renewal, probe and flush.
func (s *Shared) tick(ctx context.Context) {
	s.mu.Lock()
	gen, idle, degraded := s.seq, len(s.holds) == 0 && len(s.pending) == 0, s.degraded != nil
	s.mu.Unlock()
	if !idle || degraded {
		rctx, cancel := context.WithTimeout(ctx, s.timeout)
		ids, err := s.st.RenewTokenHolds(rctx, s.name, s.ttl)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				s.degrade(err)
			}
			return
		}
		s.judge(gen, ids)
		// The kept settlements first: coordination resumes on figures that include them.
		if !s.flush(ctx) {
			return
		}
		s.resume()
	}
	s.refreshReplicasEvery(ctx)
}

// judge counts the holds made before the renewal (seq <= gen) that it did not return,
// and not being settled, as lost.
func (s *Shared) judge(gen uint64, ids []string) {
	renewed := make(map[string]bool, len(ids))
	for _, id := range ids {
		renewed[id] = true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, h := range s.holds {
		if h.seq <= gen && !renewed[id] && !h.settling.Load() {
			delete(s.holds, id)
			s.lost.Inc()
			s.log.Warn("token budgets: a reservation expired in the store while its call was running", "tenant", h.tenant, "hold", id)
		}
	}
}

// flush charges the kept settlements, in order, until one fails; it reports whether
// none is left.
func (s *Shared) flush(ctx context.Context) bool {
	for {
		s.mu.Lock()
		if len(s.pending) == 0 {
			s.mu.Unlock()
			return true
		}
		c := s.pending[0]
		s.mu.Unlock()
		fctx, cancel := context.WithTimeout(ctx, s.timeout)
		err := s.st.SettleTokens(fctx, c)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				s.degrade(err)
			}
			return false
		}
		s.mu.Lock()
		s.pending = s.pending[1:]
		if c.ID != "" {
			delete(s.holds, c.ID)
		}
		s.mu.Unlock()
	}
}

func (s *Shared) refreshReplicasEvery(ctx context.Context) {
	if s.Degraded() || time.Since(s.replicasAt) < replicasEvery {
		return
	}
	s.refreshReplicas(ctx)
}

// refreshReplicas asks how many replicas share the budgets.
func (s *Shared) refreshReplicas(ctx context.Context) {
	s.replicasAt = time.Now() // the loop's only, after NewShared
	if s.peers == nil {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, s.timeout)
	n, err := s.peers(rctx)
	cancel()
	if err != nil || n < 1 {
		return
	}
	s.mu.Lock()
	s.replicas = n
	s.mu.Unlock()
}

// Usage returns the tenant's state in its current window, from the store.
func (s *Shared) Usage(ctx context.Context, name string) (Usage, error) {
	budget, window := s.limitsOf(name)
	st, err := s.st.TokenBudgetUsage(ctx, name, window)
	if err != nil {
		return Usage{}, fmt.Errorf("budget usage of %q: %w", name, err)
	}
	return Usage{Spent: st.Spent, Reserved: st.Reserved, Budget: budget, WindowEnd: st.WindowStart.Add(window)}, nil
}

// Close stops the renewals and tries once more to charge the kept settlements. The holds
// still in flight are left to expire in the store (their calls settle to the store if it
// is still open). Reserve fails with ErrClosed afterwards.
func (s *Shared) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.stop()
	s.wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	s.flush(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := len(s.pending); n > 0 {
		return fmt.Errorf("budget: %d settlements not charged to the store", n)
	}
	return nil
}
