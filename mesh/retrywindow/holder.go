package retrywindow

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

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/store"
)

const (
	// StoreRetry is how long retries needing a window are refused, without asking the
	// store, after a claim or a verification failed.
	StoreRetry = time.Second
	// StoreTimeout bounds each store round trip made for a window, so that a hung store
	// costs a retrying call at most this much.
	StoreTimeout = 500 * time.Millisecond
	// maxGuard caps the guard between a window's local end and its expiry in the store.
	maxGuard = 250 * time.Millisecond
)

var (
	// ErrBusy refuses a retry: other replicas hold every window of the target.
	ErrBusy = errors.New("retrywindow: other replicas hold the target's retry windows")
	// ErrStoreDown refuses a retry: the store could not be asked for a window.
	ErrStoreDown = errors.New("retrywindow: the store cannot be asked for a retry window")
	// ErrClosed refuses a retry once the Holder was closed.
	ErrClosed = errors.New("retrywindow: holder closed")
)

// Refusal is AllowRetry's refusal of a retry (ErrBusy or ErrStoreDown, which it wraps):
// it says when the window may be asked again (retry.WindowRefusal), so that a caller may
// wait for the window to move rather than fail.
type Refusal struct {
	Target string
	Err    error     // ErrBusy or ErrStoreDown, wrapping the store's error if any
	Until  time.Time // when the refusal ends: the earliest window moves, or the store is asked again
}

func (r *Refusal) Error() string { return fmt.Sprintf("%v: %s", r.Err, r.Target) }

// Unwrap returns ErrBusy or ErrStoreDown (wrapping the store's error).
func (r *Refusal) Unwrap() error { return r.Err }

// RetryAt is when the window may be asked again.
func (r *Refusal) RetryAt() time.Time { return r.Until }

var _ retry.WindowRefusal = (*Refusal)(nil)

// Config configures a Holder.
type Config struct {
	// Store holds the windows (required): a store the replicas share.
	Store store.Slots
	// Name names this process in the store: unique among live processes, never reused,
	// and not the name of any other holder of slots (see the package doc). Default:
	// hostname-pid-random/retry.
	Name string
	// Window is the number of windows per target and their length (defaults from
	// retry.WindowConfig). Off is not allowed here: do not make a Holder then.
	Window retry.WindowConfig
	// Registerer, if set, receives the metrics.
	Registerer prometheus.Registerer
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// Holder holds the retry windows of one process, per target. Safe for concurrent use.
type Holder struct {
	cfg     Config
	guard   time.Duration // a window ends this long before its TTL in the store
	verify  time.Duration // a window in use is verified this often
	metrics *metrics

	mu      sync.Mutex
	closed  bool
	targets map[string]*target
}

// target is one target's window state in this process.
type target struct {
	name  string
	scope string
	sem   chan struct{} // buffered 1: one store round trip at a time per target

	// Under Holder.mu:
	sized      bool
	lease      *store.Slot // nil while no window is held
	until      time.Time   // the window's local end (monotonic): claim start + Length - guard
	expiry     time.Time   // claim start + Length: when the store frees it
	verifiedAt time.Time
	refuse     error     // ErrBusy or ErrStoreDown, while refuseTil has not passed
	refuseTil  time.Time // no store round trip before then
	down       bool      // the last store round trip failed (logged once per outage)
	downSince  time.Time // when down became true
	refused    int64     // retries refused, since the process started
}

// TargetStatus is one target's window as this process sees it.
type TargetStatus struct {
	// Held: this process holds a window of the target now.
	Held bool
	// Slot and Epoch identify the window held (the fencing token); Until is its end.
	Slot  int
	Epoch int64
	Until time.Time
	// StoreDown: the last store round trip for this target failed, since DownSince.
	StoreDown bool
	DownSince time.Time
	// Refused counts the retries refused for want of a window (any reason) since the
	// process started.
	Refused int64
}

// New returns a Holder. It starts nothing: windows are claimed by the retries that need
// them. Close it to release the windows it holds.
func New(cfg Config) (*Holder, error) {
	if cfg.Store == nil {
		return nil, errors.New("retrywindow: Config.Store is required")
	}
	if cfg.Window.Replicas == 0 {
		cfg.Window.Replicas = retry.DefaultWindowReplicas
	}
	if cfg.Window.Length == 0 {
		cfg.Window.Length = retry.DefaultWindowLength
	}
	if cfg.Window.Off {
		return nil, errors.New("retrywindow: the window is off")
	}
	if err := cfg.Window.Validate(); err != nil {
		return nil, fmt.Errorf("retrywindow: %w", err)
	}
	if cfg.Name == "" {
		cfg.Name = defaultName()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Holder{cfg: cfg, guard: min(cfg.Window.Length/20, maxGuard), verify: cfg.Window.Length / 3,
		metrics: newMetrics(cfg.Registerer), targets: map[string]*target{}}, nil
}

func defaultName() string {
	host, _ := os.Hostname()
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s/retry", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// Name returns the holder's name in the store.
func (h *Holder) Name() string { return h.cfg.Name }

// Scope is the store scope of target's windows.
func Scope(target string) string { return "retry/" + target }

// Window is the number of windows per target and their length, defaults applied.
func (h *Holder) Window() retry.WindowConfig { return h.cfg.Window }

// Known exports target's metrics at 0 from the start, and lists it in Status.
func (h *Holder) Known(target string) {
	h.metrics.known(target)
	_, _ = h.target(target) // ErrClosed: a closed holder lists nothing new
}

// AllowRetry implements retry.Window: nil while this process holds one of target's
// windows or has just claimed one; ErrBusy, ErrStoreDown or ErrClosed (wrapped) when the
// retry must not be made. It makes no store round trip while a window is held and
// verified, nor while a refusal stands.
func (h *Holder) AllowRetry(ctx context.Context, target string) error {
	_, err := h.allow(ctx, target)
	return err
}

// allow is AllowRetry, also returning the window that allowed the retry.
func (h *Holder) allow(ctx context.Context, target string) (store.Slot, error) {
	t, err := h.target(target)
	if err != nil {
		h.metrics.refused(target, "closed")
		return store.Slot{}, err
	}
	if sl, done, err := h.quick(t); done {
		return sl, err
	}
	select {
	case t.sem <- struct{}{}:
	case <-ctx.Done():
		return store.Slot{}, ctx.Err()
	}
	defer func() { <-t.sem }()
	// Another call may have settled it while this one waited.
	if sl, done, err := h.quick(t); done {
		return sl, err
	}
	h.mu.Lock()
	held := t.lease != nil
	h.mu.Unlock()
	if held {
		return h.verifyWindow(ctx, t)
	}
	return h.claim(ctx, t)
}

func (h *Holder) target(name string) (*target, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, ErrClosed
	}
	t := h.targets[name]
	if t == nil {
		t = &target{name: name, scope: Scope(name), sem: make(chan struct{}, 1)}
		h.targets[name] = t
	}
	return t, nil
}

// quick decides without the store when it can: done is false when a claim or a
// verification is needed; sl is the window that allowed the retry.
func (h *Holder) quick(t *target) (sl store.Slot, done bool, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	if t.lease != nil {
		if now.Before(t.until) {
			if now.Sub(t.verifiedAt) < h.verify {
				return *t.lease, true, nil
			}
			return store.Slot{}, false, nil
		}
		// The window ended: it moves. Claim again only after its expiry plus the guard,
		// so that the replicas refused meanwhile, who ask at its expiry, come first.
		h.endLocked(t, "")
		t.refuse, t.refuseTil = ErrBusy, t.expiry.Add(h.guard)
	}
	if now.Before(t.refuseTil) {
		h.refusedLocked(t)
		return store.Slot{}, true, &Refusal{Target: t.name, Err: t.refuse, Until: t.refuseTil}
	}
	return store.Slot{}, false, nil
}

// claim asks the store for a window of t (one round trip; two the first time, which
// sizes the scope; two when refused, to learn when the window moves).
func (h *Holder) claim(call context.Context, t *target) (store.Slot, error) {
	ctx, cancel := context.WithTimeout(call, StoreTimeout)
	defer cancel()
	st := h.cfg.Store
	h.mu.Lock()
	sized := t.sized
	h.mu.Unlock()
	if !sized {
		if err := st.SizeSlots(ctx, t.scope, h.cfg.Window.Replicas); err != nil {
			if call.Err() != nil {
				return store.Slot{}, call.Err() // the call ended, not the store
			}
			return store.Slot{}, h.storeFailed(t, "size", err)
		}
		h.mu.Lock()
		t.sized = true
		h.mu.Unlock()
	}
	start := time.Now()
	sl, ok, err := st.ClaimSlot(ctx, t.scope, h.cfg.Name, h.cfg.Window.Length)
	if err != nil {
		if call.Err() != nil {
			return store.Slot{}, call.Err()
		}
		return store.Slot{}, h.storeFailed(t, "claim", err)
	}
	if ok {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.resumedLocked(t)
		if h.closed { // closed while claiming: give it back (it would expire anyway)
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), StoreTimeout)
			defer rcancel()
			_ = st.ReleaseSlot(rctx, sl)
			return store.Slot{}, ErrClosed
		}
		t.lease = &sl
		t.expiry = start.Add(h.cfg.Window.Length)
		t.until = t.expiry.Add(-h.guard)
		t.verifiedAt = start
		t.refuse, t.refuseTil = nil, time.Time{}
		h.metrics.claimed(t.name)
		h.cfg.Logger.Info("retry window claimed", "target", t.name, "slot", sl.N, "epoch", sl.Epoch,
			"length", h.cfg.Window.Length.String())
		return sl, nil
	}
	// Every window is held: learn when the earliest one moves, and refuse until then.
	now := time.Now()
	moves := now.Add(h.cfg.Window.Length / 10) // when the list fails
	if slots, err := st.ListSlots(ctx, t.scope); err == nil {
		moves = now.Add(h.guard) // none held any more: it moved meanwhile
		var earliest time.Time
		for _, s := range slots {
			if s.Held(now) && (earliest.IsZero() || s.Expiry.Before(earliest)) {
				earliest = s.Expiry
			}
		}
		if !earliest.IsZero() {
			moves = minTime(earliest, now.Add(h.cfg.Window.Length))
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.resumedLocked(t)
	t.refuse, t.refuseTil = ErrBusy, moves
	h.refusedLocked(t)
	return store.Slot{}, &Refusal{Target: t.name, Err: ErrBusy, Until: moves}
}

// verifyWindow checks in the store (one round trip) that t's window is still this
// process's, with its epoch; a window found lost, or that cannot be verified, ends now.
func (h *Holder) verifyWindow(call context.Context, t *target) (store.Slot, error) {
	ctx, cancel := context.WithTimeout(call, StoreTimeout)
	defer cancel()
	h.mu.Lock()
	lease := *t.lease
	h.mu.Unlock()
	slots, err := h.cfg.Store.ListSlots(ctx, t.scope)
	if err != nil && call.Err() != nil {
		return store.Slot{}, call.Err() // the call ended, not the store: the next retry verifies
	}
	now := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	if t.lease == nil || t.lease.Epoch != lease.Epoch {
		return store.Slot{}, fmt.Errorf("%w: %s", ErrBusy, t.name) // ended meanwhile (Close)
	}
	if err != nil {
		h.endLocked(t, "verify_failed")
		h.downLocked(t, "verify", err)
		return store.Slot{}, &Refusal{Target: t.name, Err: fmt.Errorf("%w: %w", ErrStoreDown, err), Until: t.refuseTil}
	}
	for _, s := range slots {
		if s.N == lease.N && s.Holder == h.cfg.Name && s.Epoch == lease.Epoch && s.Held(now) {
			t.verifiedAt = now
			h.resumedLocked(t)
			return lease, nil
		}
	}
	h.endLocked(t, "taken")
	t.refuse, t.refuseTil = ErrBusy, now.Add(h.guard)
	h.refusedLocked(t)
	return store.Slot{}, &Refusal{Target: t.name, Err: fmt.Errorf("%w (this replica's window was lost)", ErrBusy), Until: t.refuseTil}
}

// storeFailed refuses retries of t for StoreRetry after a failed round trip.
func (h *Holder) storeFailed(t *target, op string, err error) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.downLocked(t, op, err)
	return &Refusal{Target: t.name, Err: fmt.Errorf("%w: %w", ErrStoreDown, err), Until: t.refuseTil}
}

func (h *Holder) downLocked(t *target, op string, err error) {
	if !t.down {
		t.downSince = time.Now()
		h.cfg.Logger.Warn("retry windows: the store cannot be asked; retries that need a window are refused until it answers",
			"target", t.name, "op", op, "err", err)
	}
	t.down = true
	t.refuse, t.refuseTil = ErrStoreDown, time.Now().Add(min(StoreRetry, h.cfg.Window.Length))
	h.refusedLocked(t)
}

func (h *Holder) resumedLocked(t *target) {
	if t.down {
		h.cfg.Logger.Info("retry windows: the store answers again; coordination resumed", "target", t.name)
	}
	t.down = false
}

// endLocked ends t's window; reason is "" for a window that ran its length, else why it
// was lost (counted).
func (h *Holder) endLocked(t *target, reason string) {
	if t.lease == nil {
		return
	}
	if reason != "" {
		h.cfg.Logger.Warn("retry window lost", "target", t.name, "slot", t.lease.N, "epoch", t.lease.Epoch, "reason", reason)
		h.metrics.lost(t.name, reason)
	}
	t.lease = nil
	h.metrics.held(t.name, 0)
}

func (h *Holder) refusedLocked(t *target) {
	t.refused++
	reason := "busy"
	if errors.Is(t.refuse, ErrStoreDown) {
		reason = "store_down"
	}
	h.metrics.refused(t.name, reason)
}

// Status reports the window of every target this process has asked for or was told of
// (Known).
func (h *Holder) Status() map[string]TargetStatus {
	h.mu.Lock()
	defer h.mu.Unlock()
	now := time.Now()
	out := make(map[string]TargetStatus, len(h.targets))
	for name, t := range h.targets {
		s := TargetStatus{StoreDown: t.down, Refused: t.refused}
		if t.down {
			s.DownSince = t.downSince
		}
		if t.lease != nil && now.Before(t.until) {
			s.Held, s.Slot, s.Epoch, s.Until = true, t.lease.N, t.lease.Epoch, t.until
		}
		out[name] = s
	}
	return out
}

// Close refuses every later retry and releases the windows held (one round trip each,
// under ctx), so that other replicas may claim them at once rather than at expiry.
func (h *Holder) Close(ctx context.Context) error {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	var held []store.Slot
	for _, t := range h.targets {
		if t.lease != nil {
			held = append(held, *t.lease)
			h.endLocked(t, "")
		}
	}
	h.mu.Unlock()
	var errs []error
	for _, s := range held {
		if err := h.cfg.Store.ReleaseSlot(ctx, s); err != nil && !errors.Is(err, store.ErrStaleEpoch) {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("retrywindow: release %d of %d windows at close: %w", len(errs), len(held), errors.Join(errs...))
	}
	return nil
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

var _ retry.Window = (*Holder)(nil)
