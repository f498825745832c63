package clusterslots

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

const (
	// DefaultTTL is how long a slot outlives its holder's last renewal.
	DefaultTTL = 10 * time.Second
	// DefaultPoll is how often a scope with waiters tries a claim when nothing woke it.
	DefaultPoll = 250 * time.Millisecond
	// watchRetry is how long the Holder waits before listening again after a failed
	// watch of the store's release notifications (polling goes on meanwhile).
	watchRetry = 2 * time.Second
)

var (
	// ErrClosed is returned once the Holder was closed.
	ErrClosed = errors.New("clusterslots: holder closed")
	// ErrLost means a renewal came back without the slot: it had expired and another holder
	// claimed it. The cap no longer counts this caller.
	ErrLost = errors.New("clusterslots: slot lost to another holder")
	// ErrRenewFailed means renewals failed until the slot's TTL passed; it may have been
	// claimed by another holder since.
	ErrRenewFailed = errors.New("clusterslots: slot renewals failed past its TTL")
)

// Config configures a Holder.
type Config struct {
	// Store holds the slots (required). When it also implements store.SlotReleases
	// (PostgreSQL), waiters are woken by releases on other replicas.
	Store store.Slots
	// Name names this process's holder in the store; it must be unique among live
	// processes and never reused by a later one. Default: hostname-pid-random.
	Name string
	// TTL is how long a slot outlives the Holder's last renewal (default DefaultTTL);
	// renewals run every TTL/3.
	TTL time.Duration
	// Poll is the backstop period of a scope's claim loop while it has waiters
	// (default DefaultPoll).
	Poll time.Duration
	// OnRelease, if set, is called with the scope of every slot released here or, with
	// notifications, on another replica: a hint that TryAcquire may now succeed, for a
	// caller that keeps its own queue (admission's priority order) instead of Acquire's
	// FIFO. Called from the Holder's goroutines; it must not block.
	OnRelease func(scope string)
	// OnRenewError, if set, is called after every failed renewal (for metrics and
	// status), from the renewal goroutine.
	OnRenewError func(err error)
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// Holder claims and holds slots for the callers of one process. Safe for concurrent use.
type Holder struct {
	cfg  Config
	st   store.Slots
	ctx  context.Context // ends at Close: the loops' context
	stop context.CancelFunc
	wg   sync.WaitGroup

	mu     sync.Mutex
	closed bool
	gen    uint64 // incremented on every claim, see renewOnce
	held   map[*Slot]struct{}
	// unreleased are slots whose release failed (the store down): renewals renew every
	// slot of the holder's name in the store, so they are released again before each
	// renewal, or they would stay held for as long as the process lives.
	unreleased []store.Slot
	queues     map[string]*queue
	renewErr   error
	renewAt    time.Time // the start of the last successful renewal
	watching   bool
}

// queue is one scope's local waiters, served first come first served by one claim loop
// that runs while there are waiters.
type queue struct {
	waiters []*waiter
	running bool
	poke    chan struct{} // buffered 1: a release here or elsewhere, try now
}

type waiter struct {
	ch chan result // buffered 1; written once, under Holder.mu
}

type result struct {
	slot *Slot
	err  error
}

// Status is what a Holder reports for status pages and metrics.
type Status struct {
	Name string
	// Held is the number of slots held, by scope.
	Held map[string]int
	// Waiting is the number of local waiters, by scope.
	Waiting map[string]int
	// RenewError is the last renewal's error, nil once one succeeds again.
	RenewError error
	// LastRenew is when the last successful renewal started (zero before the first).
	LastRenew time.Time
	// Notified reports whether releases on other replicas wake waiters now (the store
	// supports it and the watch is up); false means polling only.
	Notified bool
}

// New starts a Holder: its renewal loop and, when the store supports it, the watch of
// release notifications. Close it to stop them and release its slots.
func New(cfg Config) (*Holder, error) {
	if cfg.Store == nil {
		return nil, errors.New("clusterslots: Config.Store is required")
	}
	if cfg.TTL == 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.Poll == 0 {
		cfg.Poll = DefaultPoll
	}
	if cfg.TTL < 3*time.Millisecond || cfg.Poll < 0 {
		return nil, fmt.Errorf("clusterslots: TTL %v (at least 3ms) or Poll %v (positive) out of range", cfg.TTL, cfg.Poll)
	}
	if cfg.Name == "" {
		cfg.Name = defaultName()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ctx, stop := context.WithCancel(context.Background())
	h := &Holder{
		cfg: cfg, st: cfg.Store, ctx: ctx, stop: stop,
		held: map[*Slot]struct{}{}, queues: map[string]*queue{},
	}
	h.wg.Add(1)
	go h.renewLoop()
	if w, ok := cfg.Store.(store.SlotReleases); ok {
		h.wg.Add(1)
		go h.watchLoop(w)
	}
	return h, nil
}

func defaultName() string {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// Name returns the holder's name in the store.
func (h *Holder) Name() string { return h.cfg.Name }

// Size sets the scope's number of slots cluster-wide (store.Slots.SizeSlots: a shrink
// cuts no holder off). Every replica calls it with its configuration at start and on
// reload; the last one wins.
func (h *Holder) Size(ctx context.Context, scope string, n int) error {
	return h.st.SizeSlots(ctx, scope, n)
}

// TryAcquire claims a slot of scope if one is free now, in one store round trip: ok is
// false when every slot is held. It does not queue, and it does not jump a local queue
// either: while the scope has local waiters it returns false without asking the store.
func (h *Holder) TryAcquire(ctx context.Context, scope string) (s *Slot, ok bool, err error) {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil, false, ErrClosed
	}
	if q := h.queues[scope]; q != nil && len(q.waiters) > 0 {
		h.mu.Unlock()
		return nil, false, nil
	}
	h.mu.Unlock()
	return h.claim(ctx, scope)
}

// Acquire returns a slot of scope, waiting in the scope's local queue while every slot
// is held, until ctx ends (its error is returned). A store error while waiting ends the
// wait of every waiter of the scope with that error: the caller decides what to do when
// the store is down (docs/cluster.md).
func (h *Holder) Acquire(ctx context.Context, scope string) (*Slot, error) {
	s, ok, err := h.TryAcquire(ctx, scope)
	if err != nil || ok {
		return s, err
	}
	w := &waiter{ch: make(chan result, 1)}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil, ErrClosed
	}
	q := h.queues[scope]
	if q == nil {
		q = &queue{poke: make(chan struct{}, 1)}
		h.queues[scope] = q
	}
	q.waiters = append(q.waiters, w)
	if !q.running {
		q.running = true
		h.wg.Add(1)
		go h.claimLoop(scope, q) //nolint:contextcheck // the scope's claim loop serves every waiter of the scope, not this call: it outlives ctx by design
	}
	h.mu.Unlock()
	select {
	case r := <-w.ch:
		return r.slot, r.err
	case <-ctx.Done():
	}
	h.mu.Lock()
	for i, x := range q.waiters {
		if x == w {
			q.waiters = append(q.waiters[:i], q.waiters[i+1:]...)
			h.mu.Unlock()
			return nil, ctx.Err()
		}
	}
	h.mu.Unlock()
	// Served meanwhile: give the slot back.
	if r := <-w.ch; r.slot != nil {
		_ = r.slot.Release(context.WithoutCancel(ctx))
	}
	return nil, ctx.Err()
}

// claim runs one store claim and registers the slot.
func (h *Holder) claim(ctx context.Context, scope string) (*Slot, bool, error) {
	start := time.Now()
	sl, ok, err := h.st.ClaimSlot(ctx, scope, h.cfg.Name, h.cfg.TTL)
	if err != nil {
		return nil, false, fmt.Errorf("clusterslots: claim a slot of %s: %w", scope, err)
	}
	if !ok {
		return nil, false, nil
	}
	ss, err := h.register(ctx, start, sl)
	if err != nil {
		return nil, false, err
	}
	return ss[0], true, nil
}

// register records claimed slots as held, renewed from now on.
func (h *Holder) register(ctx context.Context, start time.Time, sls ...store.Slot) ([]*Slot, error) {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		// Closed while claiming: Close no longer sees them, so release them here (after
		// the TTL they would free themselves anyway).
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.cfg.TTL/3)
		_, _ = h.st.ReleaseSlots(rctx, sls)
		cancel()
		return nil, ErrClosed
	}
	h.gen++
	out := make([]*Slot, len(sls))
	for i, sl := range sls {
		s := &Slot{h: h, info: sl, lost: make(chan struct{}), deadline: start.Add(h.cfg.TTL), gen: h.gen}
		h.held[s] = struct{}{}
		out[i] = s
	}
	h.mu.Unlock()
	return out, nil
}

// TryAcquireAll claims one slot of each of the distinct scopes (a run's pool and its
// tenant), all or none, in one store round trip: ok is false, and nothing is held,
// while any of them is full. It ignores Acquire's local queues: it is for a caller with
// a queue of its own (see Config.OnRelease). Release the slots with ReleaseAll (one
// round trip) or one by one.
func (h *Holder) TryAcquireAll(ctx context.Context, scopes ...string) ([]*Slot, bool, error) {
	h.mu.Lock()
	closed := h.closed
	h.mu.Unlock()
	if closed {
		return nil, false, ErrClosed
	}
	start := time.Now()
	sls, ok, err := h.st.ClaimSlots(ctx, scopes, h.cfg.Name, h.cfg.TTL)
	if err != nil {
		return nil, false, fmt.Errorf("clusterslots: claim slots of %v: %w", scopes, err)
	}
	if !ok {
		return nil, false, nil
	}
	ss, err := h.register(ctx, start, sls...)
	if err != nil {
		return nil, false, err
	}
	return ss, true, nil
}

// ReleaseAll releases the slots in one store round trip (Release's rules for each),
// and wakes their scopes' waiters.
func (h *Holder) ReleaseAll(ctx context.Context, slots ...*Slot) error {
	var infos []store.Slot
	for _, s := range slots {
		s.mu.Lock()
		released := s.released
		s.released = true
		s.mu.Unlock()
		if released {
			continue
		}
		h.mu.Lock()
		delete(h.held, s)
		infos = append(infos, s.info)
		h.mu.Unlock()
	}
	if len(infos) == 0 {
		return nil
	}
	_, err := h.st.ReleaseSlots(ctx, infos)
	for _, in := range infos {
		h.wake(in.Scope)
	}
	if err != nil {
		h.keepUnreleased(infos...)
		return fmt.Errorf("clusterslots: release %d slots: %w", len(infos), err)
	}
	return nil
}

// keepUnreleased remembers slots whose release failed, for the renew loop to release.
func (h *Holder) keepUnreleased(sls ...store.Slot) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.unreleased = append(h.unreleased, sls...)
}

// releaseUnreleased tries the failed releases again; it reports whether none is left.
func (h *Holder) releaseUnreleased(ctx context.Context) bool {
	h.mu.Lock()
	pending := h.unreleased
	h.unreleased = nil
	h.mu.Unlock()
	if len(pending) == 0 {
		return true
	}
	if _, err := h.st.ReleaseSlots(ctx, pending); err != nil {
		h.keepUnreleased(pending...)
		return false
	}
	for _, in := range pending {
		h.wake(in.Scope)
	}
	return true
}

// claimLoop serves scope's waiters in order: one claim whenever poked (a release) or
// every Poll, at once again after a success, until the queue is empty.
func (h *Holder) claimLoop(scope string, q *queue) {
	defer h.wg.Done()
	t := time.NewTicker(h.cfg.Poll)
	defer t.Stop()
	for {
		h.mu.Lock()
		if len(q.waiters) == 0 || h.closed {
			q.running = false
			if h.queues[scope] == q {
				delete(h.queues, scope) // scopes come and go (tenants): keep the map bounded
			}
			h.mu.Unlock()
			return
		}
		h.mu.Unlock()
		ctx, cancel := context.WithTimeout(h.ctx, h.cfg.TTL/3)
		s, ok, err := h.claim(ctx, scope)
		cancel()
		if errors.Is(err, ErrClosed) || h.ctx.Err() != nil {
			continue // the loop's check above ends it
		}
		h.mu.Lock()
		switch {
		case err != nil:
			for _, w := range q.waiters {
				w.ch <- result{err: err}
			}
			q.waiters = nil
		case ok && len(q.waiters) > 0:
			w := q.waiters[0]
			q.waiters = q.waiters[1:]
			w.ch <- result{slot: s}
		case ok: // every waiter left meanwhile
			h.mu.Unlock()
			_ = s.Release(h.ctx)
			continue
		}
		h.mu.Unlock()
		if ok {
			continue // more may be free
		}
		select {
		case <-q.poke:
		case <-t.C:
		case <-h.ctx.Done():
		}
	}
}

// wake makes scope's claim loop try now, if it runs, and tells Config.OnRelease.
func (h *Holder) wake(scope string) {
	h.mu.Lock()
	if q := h.queues[scope]; q != nil && q.running {
		select {
		case q.poke <- struct{}{}:
		default:
		}
	}
	h.mu.Unlock()
	if h.cfg.OnRelease != nil {
		h.cfg.OnRelease(scope)
	}
}

// renewLoop renews every held slot every TTL/3, in one statement.
func (h *Holder) renewLoop() {
	defer h.wg.Done()
	t := time.NewTicker(h.cfg.TTL / 3)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-h.ctx.Done():
			return
		}
		h.renewOnce()
	}
}

// renewOnce renews the held slots and settles which are lost. A slot claimed after the
// renewal started may be missing from its answer without being lost: only slots of a
// generation up to the one seen at the start are judged.
func (h *Holder) renewOnce() {
	h.mu.Lock()
	n, gen, pending := len(h.held), h.gen, len(h.unreleased)
	h.mu.Unlock()
	if n == 0 && pending == 0 {
		return // nothing held: no round trip
	}
	start := time.Now()
	// A renewal that hangs (the store unreachable) must not hold up the next tick's
	// judgement of which slots are lost.
	ctx, cancel := context.WithTimeout(h.ctx, h.cfg.TTL/3)
	defer cancel()
	// Release first what could not be released: the renewal below would keep it held.
	// While that fails the renewal is skipped too; the slots held expire at worst, which
	// the loss rules below report.
	var got []store.Slot
	var err error
	if h.releaseUnreleased(ctx) {
		if n == 0 {
			return
		}
		got, err = h.st.RenewSlots(ctx, h.cfg.Name, h.cfg.TTL)
	} else {
		err = errors.New("releasing the slots whose release failed")
	}
	cancel()
	if h.ctx.Err() != nil {
		return
	}
	type key struct {
		scope string
		n     int
		epoch int64
	}
	renewed := make(map[key]store.Slot, len(got))
	for _, sl := range got {
		renewed[key{sl.Scope, sl.N, sl.Epoch}] = sl
	}
	h.mu.Lock()
	var lost []*Slot
	if err != nil {
		h.renewErr = fmt.Errorf("clusterslots: renew %d slots: %w", n, err)
		now := time.Now()
		for s := range h.held {
			if !now.Before(s.deadline) {
				s.err = fmt.Errorf("%w (last error: %w)", ErrRenewFailed, err)
				lost = append(lost, s)
			}
		}
	} else {
		h.renewErr, h.renewAt = nil, start
		for s := range h.held {
			if sl, ok := renewed[key{s.info.Scope, s.info.N, s.info.Epoch}]; ok {
				s.info.Expiry, s.info.Active, s.deadline = sl.Expiry, sl.Active, start.Add(h.cfg.TTL)
			} else if s.gen <= gen {
				s.err = ErrLost
				lost = append(lost, s)
			}
		}
	}
	for _, s := range lost {
		delete(h.held, s)
		close(s.lost)
	}
	renewErr := h.renewErr
	h.mu.Unlock()
	for _, s := range lost {
		h.cfg.Logger.Warn("cluster slot lost", "scope", s.info.Scope, "slot", s.info.N, "epoch", s.info.Epoch, "err", s.err)
	}
	if renewErr != nil {
		h.cfg.Logger.Warn("cluster slots: renewal failed", "err", renewErr)
		if h.cfg.OnRenewError != nil {
			h.cfg.OnRenewError(renewErr)
		}
	}
}

// watchLoop wakes the claim loop of every scope a release on any replica names, and
// listens again after a failure.
func (h *Holder) watchLoop(w store.SlotReleases) {
	defer h.wg.Done()
	for h.ctx.Err() == nil {
		done, err := w.WatchSlotReleases(h.ctx, h.wake)
		if err == nil {
			h.setWatching(true)
			err = <-done
			h.setWatching(false)
		}
		if err != nil && h.ctx.Err() == nil {
			h.cfg.Logger.Warn("cluster slots: release notifications down, polling only", "err", err, "retry_in", watchRetry)
		}
		select {
		case <-time.After(watchRetry):
		case <-h.ctx.Done():
		}
	}
}

func (h *Holder) setWatching(on bool) {
	h.mu.Lock()
	h.watching = on
	h.mu.Unlock()
}

// Status reports what the Holder holds and waits for.
func (h *Holder) Status() Status {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := Status{Name: h.cfg.Name, Held: map[string]int{}, Waiting: map[string]int{}, RenewError: h.renewErr,
		LastRenew: h.renewAt, Notified: h.watching}
	for s := range h.held {
		st.Held[s.info.Scope]++
	}
	for scope, q := range h.queues {
		if len(q.waiters) > 0 {
			st.Waiting[scope] = len(q.waiters)
		}
	}
	return st
}

// Close stops the loops, ends every wait with ErrClosed and releases the held slots
// (one store round trip each, under ctx), so other replicas get them at once instead of
// after the TTL. Slots it could not release expire. Their Release is a no-op afterwards.
func (h *Holder) Close(ctx context.Context) error {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	for _, q := range h.queues {
		for _, w := range q.waiters {
			w.ch <- result{err: ErrClosed}
		}
		q.waiters = nil
	}
	held := make([]*Slot, 0, len(h.held))
	for s := range h.held {
		held = append(held, s)
	}
	h.held = map[*Slot]struct{}{}
	h.mu.Unlock()
	h.stop()
	h.wg.Wait()
	var errs []error
	for _, s := range held {
		s.mu.Lock()
		s.released = true
		s.mu.Unlock()
		if err := h.st.ReleaseSlot(ctx, s.info); err != nil && !errors.Is(err, store.ErrStaleEpoch) {
			errs = append(errs, err)
		}
	}
	if !h.releaseUnreleased(ctx) {
		errs = append(errs, errors.New("the slots whose release had failed are still held"))
	}
	if len(errs) > 0 {
		return fmt.Errorf("clusterslots: release %d of %d slots at close: %w", len(errs), len(held), errors.Join(errs...))
	}
	return nil
}

// Slot is one slot held for one caller, until Release.
type Slot struct {
	h    *Holder
	lost chan struct{} // closed when lost (under h.mu)
	gen  uint64

	// Under h.mu:
	info     store.Slot
	deadline time.Time // by this process's monotonic clock: when the TTL runs out without renewal
	err      error

	mu       sync.Mutex
	released bool
}

// Info returns the slot as the store last reported it (scope, number, epoch, expiry).
func (s *Slot) Info() store.Slot {
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	return s.info
}

// Lost is closed when the slot is lost: the caller's work no longer counts against the
// cap (see Err, and docs/cluster.md for what to do).
func (s *Slot) Lost() <-chan struct{} { return s.lost }

// Err is nil while the slot is held, then ErrLost or ErrRenewFailed (wrapping the
// store's error) once Lost is closed.
func (s *Slot) Err() error {
	s.h.mu.Lock()
	defer s.h.mu.Unlock()
	return s.err
}

// Release gives the slot back to the store (one round trip) and wakes the scope's
// local waiters. Releasing again, or after Close, does nothing. A lost slot is released
// too (after failed renewals it may still be ours in the store), but a slot the store
// had already given to another holder is not freed: its epoch moved on.
func (s *Slot) Release(ctx context.Context) error {
	s.mu.Lock()
	if s.released {
		s.mu.Unlock()
		return nil
	}
	s.released = true
	s.mu.Unlock()
	h := s.h
	h.mu.Lock()
	delete(h.held, s)
	info := s.info
	h.mu.Unlock()
	err := h.st.ReleaseSlot(ctx, info)
	h.wake(info.Scope)
	if errors.Is(err, store.ErrStaleEpoch) {
		return nil // it had expired and been claimed: nothing of ours to free
	}
	if err != nil {
		h.keepUnreleased(info)
		return fmt.Errorf("clusterslots: release slot %s/%d: %w", info.Scope, info.N, err)
	}
	return nil
}
