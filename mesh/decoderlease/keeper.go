package decoderlease

import (
	"context"
	"fmt"
	"log/slog"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// Defaults of Options' zero fields.
const (
	// DefaultPeriod is seed 003's heartbeat: 4 s.
	DefaultPeriod = 4 * time.Second
	// DefaultMinTick bounds the keeper's wake-ups below.
	DefaultMinTick = 50 * time.Millisecond
	// MaxBatch is the most keys one RenewLeases call carries (about 100 bytes each); a
	// tenant with more leases due at once gets several calls.
	MaxBatch = 4096
)

// Options configure a Keeper. The zero value is usable: every field has a default.
type Options struct {
	// Period is the longest interval between two renewals of a lease; each lease is
	// renewed at least every min(Period, remaining / 3). DefaultPeriod when 0. A drill may
	// lengthen it to reproduce heartbeats that are slower than the slack.
	Period time.Duration
	// TTL is the lease time to live the keeper asks for, at Generate and on each renewal.
	// 3 × Period when 0: two renewals in a row may be lost before a lease lapses.
	TTL time.Duration
	// MinTick is the shortest renewal period, however little time a call has left.
	// DefaultMinTick when 0.
	MinTick time.Duration
	// Log receives a warning when renewals start failing (once per streak) and a note when
	// they recover; slog.Default() when nil.
	Log *slog.Logger
}

// WithDefaults returns o with its zero fields set to their defaults.
func (o Options) WithDefaults() Options {
	if o.Period <= 0 {
		o.Period = DefaultPeriod
	}
	if o.MinTick <= 0 {
		o.MinTick = DefaultMinTick
	}
	if o.TTL <= 0 {
		o.TTL = 3 * o.Period
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	return o
}

// Client is the part of modelproxyv1.ModelProxyServiceClient a Keeper calls.
type Client interface {
	RenewLeases(ctx context.Context, in *modelproxyv1.RenewLeasesRequest, opts ...grpc.CallOption) (*modelproxyv1.RenewLeasesResponse, error)
}

// Key names a decoder's lease; the tenant is the one on the context given to Hold.
type Key struct {
	RunID, NodeID, RetryID string
}

// Stats are a Keeper's counters since it was made.
type Stats struct {
	Calls   uint64 // RenewLeases calls made
	Renewed uint64 // keys sent in them
	Unknown uint64 // keys the server said it held no lease for
	Failed  uint64 // calls that failed
	Held    int    // leases held now
}

// Keeper renews the decoder leases of one modelproxy connection. It is safe for
// concurrent use; the zero value is not usable, call New or Shared. A nil *Keeper holds
// nothing: Hold returns a nil *Lease, whose Release does nothing.
type Keeper struct {
	c      Client
	o      Options                // Period and TTL are timing's: a reload changes them
	timing atomic.Pointer[timing] // see SetTiming

	mu      sync.Mutex
	leases  map[*Lease]struct{}
	running bool          // the renewal goroutine runs
	wakeAt  time.Time     // when it wakes next, while running
	wake    chan struct{} // wakes it early: an earlier lease, or none left
	failing bool          // the last call failed (logged once per streak)
	stats   Stats
}

// Lease is one decoder's lease, held from Hold until Release.
type Lease struct {
	k        *Keeper
	tenant   string
	key      *modelproxyv1.LeaseKey // sent as is in every renewal; never modified
	deadline time.Time              // the model call's; zero when none
	every    time.Duration          // HoldEvery's fixed period; 0 for the usual rule
	// Under k.mu:
	last   time.Time     // registered or last renewed
	period time.Duration // the period chosen at last
	next   time.Time     // last + period: due
}

// timing is a keeper's renewal period and lease TTL.
type timing struct {
	period, ttl time.Duration
	ttlProto    *durationpb.Duration // sent with every call; never modified
}

// New returns a keeper that renews through c.
func New(c Client, o Options) *Keeper {
	o = o.WithDefaults()
	k := &Keeper{c: c, o: o, leases: map[*Lease]struct{}{}, wake: make(chan struct{}, 1)}
	k.timing.Store(&timing{period: o.Period, ttl: o.TTL, ttlProto: durationpb.New(o.TTL)})
	return k
}

// SetTiming changes the keeper's renewal period and lease TTL (0: 3 × period), as a
// reload of the decoder configuration does: calls that start afterwards ask for the new
// TTL, every renewal from now on sends it, and each held lease takes the new period
// from its next renewal (a shorter period wakes the keeper now). It refuses a period
// below MinTick or a TTL below the period, and then changes nothing.
func (k *Keeper) SetTiming(period, ttl time.Duration) error {
	if ttl == 0 {
		ttl = 3 * period
	}
	if period < k.o.MinTick || ttl < period {
		return fmt.Errorf("decoderlease: heartbeat %v must be at least %v and the lease TTL %v at least the heartbeat", period, k.o.MinTick, ttl)
	}
	k.timing.Store(&timing{period: period, ttl: ttl, ttlProto: durationpb.New(ttl)})
	k.mu.Lock()
	now := time.Now()
	for l := range k.leases {
		if p := k.period(l, now); l.last.Add(p).Before(l.next) {
			l.period, l.next = p, l.last.Add(p)
		}
	}
	k.mu.Unlock()
	k.signal()
	return nil
}

var shared struct {
	mu sync.Mutex
	m  map[sharedKey]*Keeper
}

type sharedKey struct {
	c Client
	o Options
}

// Shared returns the process-wide keeper of client c with options o, making it on first
// use: every agent loop of a process that streams from the same modelproxy client renews
// through one keeper, in one call per tick. A client whose type cannot be a map key gets
// a keeper of its own. nil for a nil c.
func Shared(c Client, o Options) *Keeper {
	if c == nil {
		return nil
	}
	if t := reflect.TypeOf(c); !t.Comparable() {
		return New(c, o)
	}
	o = o.WithDefaults()
	k := sharedKey{c, o}
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.m == nil {
		shared.m = map[sharedKey]*Keeper{}
	}
	kp := shared.m[k]
	if kp == nil {
		kp = New(c, o)
		shared.m[k] = kp
	}
	return kp
}

// Options returns the keeper's options, defaults applied, with the current period and
// TTL (SetTiming).
func (k *Keeper) Options() Options {
	o, t := k.o, k.timing.Load()
	o.Period, o.TTL = t.period, t.ttl
	return o
}

// TTLProto is the lease TTL to send as GenerateRequest.lease_ttl. It is shared by every
// request: do not modify it. nil for a nil keeper (the server's default TTL).
func (k *Keeper) TTLProto() *durationpb.Duration {
	if k == nil {
		return nil
	}
	return k.timing.Load().ttlProto
}

// Stats returns the keeper's counters.
func (k *Keeper) Stats() Stats {
	k.mu.Lock()
	defer k.mu.Unlock()
	s := k.stats
	s.Held = len(k.leases)
	return s
}

// Hold registers the lease of the decoder named by key, whose call runs under ctx (its
// tenant and deadline are read from ctx), and keeps renewing it until Release. Call it
// when the decoder's stream opens.
func (k *Keeper) Hold(ctx context.Context, key Key) *Lease { return k.HoldEvery(ctx, key, 0) }

// HoldEvery is Hold with a fixed renewal period every (> 0) that bypasses both the
// keeper's Period and the remaining / 3 rule: the chaos setting slow-heartbeat (package
// chaos), which reproduces seed 003's fault "heartbeats slower than the slack". It is
// never used outside drills; every <= 0 is Hold.
func (k *Keeper) HoldEvery(ctx context.Context, key Key, every time.Duration) *Lease {
	if k == nil {
		return nil
	}
	now := time.Now()
	l := &Lease{k: k, tenant: md.IdentityFrom(ctx).Tenant, last: now, every: max(every, 0),
		key: &modelproxyv1.LeaseKey{RunId: key.RunID, NodeId: key.NodeID, RetryId: key.RetryID}}
	if dl, ok := ctx.Deadline(); ok {
		l.deadline = dl
	}
	l.period = k.period(l, now)
	l.next = now.Add(l.period)
	k.mu.Lock()
	k.leases[l] = struct{}{}
	start := !k.running
	switch {
	case start:
		k.running, k.wakeAt = true, l.next
	case l.next.Before(k.wakeAt):
		k.wakeAt = l.next
		k.signal()
	}
	k.mu.Unlock()
	if start {
		go k.loop() //nolint:contextcheck // the keeper's goroutine serves every lease, not this call: it outlives ctx by design
	}
	return l
}

// Release stops renewing the lease. Call it when the decoder's stream has ended. It is
// safe to call more than once, and on a nil *Lease.
func (l *Lease) Release() {
	if l == nil {
		return
	}
	k := l.k
	k.mu.Lock()
	defer k.mu.Unlock()
	if _, ok := k.leases[l]; !ok {
		return
	}
	delete(k.leases, l)
	if len(k.leases) == 0 {
		k.signal() // the goroutine ends now rather than at its next tick
	}
}

// signal wakes the renewal goroutine; k.mu is held.
func (k *Keeper) signal() {
	select {
	case k.wake <- struct{}{}:
	default:
	}
}

// period is the renewal period of l at now: min(Period, remaining / 3), at least MinTick;
// HoldEvery's fixed period when it has one.
func (k *Keeper) period(l *Lease, now time.Time) time.Duration {
	if l.every > 0 {
		return max(l.every, k.o.MinTick)
	}
	p := k.timing.Load().period
	if !l.deadline.IsZero() {
		if r := l.deadline.Sub(now) / 3; r < p {
			p = r
		}
	}
	return max(p, k.o.MinTick)
}

// batch is the keys of one tenant renewed together.
type batch struct {
	tenant  string
	keys    []*modelproxyv1.LeaseKey
	timeout time.Duration // the shortest period among them
}

// loop renews the leases while there are any. One goroutine per keeper, started by the
// first Hold and ended when the last lease is released.
func (k *Keeper) loop() {
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		k.mu.Lock()
		if len(k.leases) == 0 {
			k.running = false
			k.mu.Unlock()
			return
		}
		batches := k.dueLocked(time.Now())
		k.mu.Unlock()
		for _, b := range batches {
			k.renew(b)
		}
		k.mu.Lock()
		wait := time.Until(k.wakeAt)
		k.mu.Unlock()
		t.Reset(max(wait, k.o.MinTick))
		select {
		case <-t.C:
		case <-k.wake:
		}
	}
}

// dueLocked picks the leases to renew at now and reschedules them; it sets k.wakeAt to
// the next lease due. A lease is due at its next renewal (up to half a MinTick early, so
// that leases due together go together). A tenant with a lease due is renewed in one
// call, which also carries every lease of that tenant that has used half its period:
// leases then keep in step instead of each costing a call of its own.
func (k *Keeper) dueLocked(now time.Time) []batch {
	horizon := now.Add(k.o.MinTick / 2)
	due := func(l *Lease) bool { return !l.next.After(horizon) }
	var tenants map[string]bool
	for l := range k.leases {
		if due(l) {
			if tenants == nil {
				tenants = map[string]bool{}
			}
			tenants[l.tenant] = true
		}
	}
	var out []batch
	k.wakeAt = time.Time{}
	for l := range k.leases {
		if due(l) || (tenants[l.tenant] && !now.Before(l.last.Add(l.period/2))) {
			i := 0
			for i < len(out) && out[i].tenant != l.tenant {
				i++
			}
			if i == len(out) {
				out = append(out, batch{tenant: l.tenant, timeout: l.period})
			}
			out[i].keys = append(out[i].keys, l.key)
			l.last = now
			l.period = k.period(l, now)
			l.next = now.Add(l.period)
			out[i].timeout = min(out[i].timeout, l.period)
		}
		if k.wakeAt.IsZero() || l.next.Before(k.wakeAt) {
			k.wakeAt = l.next
		}
	}
	return out
}

// renew sends one tenant's batch, in calls of at most MaxBatch keys. The calls may take
// until the batch's next renewal is due, and at least 4 × MinTick.
func (k *Keeper) renew(b batch) {
	timeout := max(b.timeout, 4*k.o.MinTick)
	ctx, cancel := context.WithTimeout(md.WithIdentity(context.Background(), md.Identity{Tenant: b.tenant}), timeout)
	defer cancel()
	for len(b.keys) > 0 {
		n := min(len(b.keys), MaxBatch)
		t := k.timing.Load()
		resp, err := k.c.RenewLeases(ctx, &modelproxyv1.RenewLeasesRequest{Keys: b.keys[:n], Ttl: t.ttlProto})
		k.mu.Lock()
		k.stats.Calls++
		k.stats.Renewed += uint64(n)
		if err != nil {
			k.stats.Failed++
		} else {
			k.stats.Unknown += uint64(len(resp.GetUnknown()))
		}
		was := k.failing
		k.failing = err != nil
		k.mu.Unlock()
		switch {
		case err != nil && !was:
			k.o.Log.Warn("decoder lease renewal failed; the decoders stop by themselves if it keeps failing past their TTL",
				"tenant", b.tenant, "keys", n, "ttl", t.ttl.String(), "error", err.Error())
		case err == nil && was:
			k.o.Log.Info("decoder lease renewal recovered", "tenant", b.tenant, "keys", n)
		}
		b.keys = b.keys[n:]
	}
}
