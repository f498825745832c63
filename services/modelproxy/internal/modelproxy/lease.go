package modelproxy

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// Decoder leases (docs/leases.md). Every decoder holds a lease keyed by (tenant, run,
// node, retry-id) from its start; the caller's side renews it (RenewLeases) and a decoder
// whose lease lapses is cancelled with cause lease_expired, so it stops by itself even
// when its caller's cancel never arrived.
//
// One time.AfterFunc timer per decoder rather than one timer (and goroutine) per
// process: a runtime timer costs no goroutine until it fires, and a renewal only moves
// the lease's expiry under the table's lock, without touching the timer. When the timer
// fires it compares the expiry with the clock and, if the lease was renewed meanwhile,
// re-arms itself for the new expiry; so a renewed lease costs one timer wake-up per TTL,
// and a lapse is detected at its expiry, to the timer's precision. A process-wide timer
// would need a goroutine of its own for the life of the process and a heap of expiries
// kept in order on every renewal, for the same wake-ups.

const (
	// DefaultLeaseTTL is the TTL of a decoder's lease when the caller names none: seed
	// 003's 4 s heartbeats × 3.
	DefaultLeaseTTL = 12 * time.Second
	// MinLeaseTTL is the shortest TTL a caller may ask for (or --decoder-lease-ttl set):
	// the keeper's shortest renewal period (decoderlease.DefaultMinTick).
	MinLeaseTTL = 50 * time.Millisecond
)

// ValidateLeaseTTL checks a --decoder-lease-ttl value: 0 (no lease unless the caller asks
// for one) or at least MinLeaseTTL.
func ValidateLeaseTTL(d time.Duration) error {
	if d < 0 || (d > 0 && d < MinLeaseTTL) {
		return fmt.Errorf("must be 0 (off) or at least %v, got %v", MinLeaseTTL, d)
	}
	return nil
}

// leaseKey names a lease. run and node are the ones the node table uses (unattributed
// for a call that named none), on Generate and on RenewLeases alike.
type leaseKey struct{ tenant, run, node, retry string }

// lease is one decoder's lease. Its fields change under the table's lock.
type lease struct {
	key     leaseKey
	ttl     time.Duration
	last    time.Time // the start or the last renewal
	expiry  time.Time // last + the TTL it was given
	armed   time.Time // when the timer fires
	timer   *time.Timer
	current bool // in the table: ended, lapsed and displaced leases are not
	// onLapse, when set, is also told when the lease lapses: a decoder that decodes
	// detached from its node's context (provider.Detached) is stopped only through it.
	onLapse func()
}

// Leases is the decoder lease table of a modelproxy. It is safe for concurrent use. A
// nil *Leases holds no lease (Server.Leases nil turns leases off).
type Leases struct {
	// TTL is the lease TTL of decoders whose caller names none; 0 gives those no lease.
	TTL time.Duration
	// lapse cancels the decoder of a lapsed lease.
	lapse func(l *lease)

	mu sync.Mutex
	m  map[leaseKey]*lease
}

func newLeases(ttl time.Duration, lapse func(*lease)) *Leases {
	return &Leases{TTL: ttl, lapse: lapse, m: map[leaseKey]*lease{}}
}

// requestTTL returns the TTL a request asks for: d when set, else the table's default.
func (t *Leases) requestTTL(d *durationpb.Duration, what string) (time.Duration, error) {
	if t == nil {
		return 0, nil
	}
	if d == nil {
		return t.TTL, nil
	}
	if err := d.CheckValid(); err != nil {
		return 0, status.Errorf(codes.InvalidArgument, "%s: %v", what, err)
	}
	ttl := d.AsDuration()
	switch {
	case ttl == 0:
		return t.TTL, nil
	case ttl < 0:
		return 0, status.Errorf(codes.InvalidArgument, "%s must not be negative, got %v", what, ttl)
	case ttl < MinLeaseTTL:
		return 0, status.Errorf(codes.InvalidArgument, "%s must be at least %v, got %v", what, MinLeaseTTL, ttl)
	}
	return ttl, nil
}

// hold registers the lease of a decoder starting now, with ttl (no lease when 0). A lease
// with the same key (an earlier attempt of the same retry-id, being superseded) is
// displaced: renewals go to the newest, and the earlier one no longer lapses.
func (t *Leases) hold(key leaseKey, ttl time.Duration) *lease { return t.holdWith(key, ttl, nil) }

// holdWith is hold with a func called, besides the node's cancel, when the lease lapses.
func (t *Leases) holdWith(key leaseKey, ttl time.Duration, onLapse func()) *lease {
	if t == nil || ttl <= 0 {
		return nil
	}
	now := time.Now()
	l := &lease{key: key, ttl: ttl, last: now, expiry: now.Add(ttl), armed: now.Add(ttl), current: true, onLapse: onLapse}
	t.mu.Lock()
	defer t.mu.Unlock()
	if old := t.m[key]; old != nil {
		old.current = false
	}
	t.m[key] = l
	l.timer = time.AfterFunc(ttl, func() { t.fire(l) }) // under the lock: fire reads l.timer
	return l
}

// end releases the lease of a decoder that has ended.
func (t *Leases) end(l *lease) {
	if l == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	l.timer.Stop()
	if l.current {
		l.current = false
		delete(t.m, l.key)
	}
}

// fire runs when l's timer does: it re-arms the timer if the lease was renewed since,
// and otherwise lapses the lease and cancels its decoder.
func (t *Leases) fire(l *lease) {
	t.mu.Lock()
	if !l.current {
		t.mu.Unlock()
		return
	}
	now := time.Now()
	if wait := l.expiry.Sub(now); wait > 0 {
		l.armed = l.expiry
		l.timer.Reset(wait)
		t.mu.Unlock()
		return
	}
	l.current = false
	delete(t.m, l.key)
	t.mu.Unlock()
	t.lapse(l) // outside the lock: the decoder's end takes it
}

// renew extends the tenant's leases named by keys to now+ttl (each lease's own TTL when
// ttl is 0) and returns the keys it holds no lease for.
func (t *Leases) renew(tenant string, keys []*modelproxyv1.LeaseKey, ttl time.Duration) []*modelproxyv1.LeaseKey {
	if t == nil {
		return keys
	}
	var unknown []*modelproxyv1.LeaseKey
	now := time.Now()
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, k := range keys {
		run, node := k.GetRunId(), k.GetNodeId()
		if run == "" {
			run = unattributed
		}
		if node == "" {
			node = unattributed
		}
		l := t.m[leaseKey{tenant, run, node, k.GetRetryId()}]
		if l == nil {
			unknown = append(unknown, k)
			continue
		}
		d := ttl
		if d == 0 {
			d = l.ttl
		}
		l.last, l.expiry = now, now.Add(d)
		if l.expiry.Before(l.armed) { // a shorter TTL than before: the timer must fire sooner
			l.armed = l.expiry
			l.timer.Reset(d)
		}
	}
	return unknown
}

// oldest returns the age of the least recently renewed live lease (since its start when
// never renewed), 0 when there is none.
func (t *Leases) oldest(now time.Time) time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	var age time.Duration
	for _, l := range t.m {
		age = max(age, now.Sub(l.last))
	}
	return age
}

// lastRenewal returns when l was last renewed (its start when never), zero for no lease.
func (t *Leases) lastRenewal(l *lease) time.Time {
	if t == nil || l == nil {
		return time.Time{}
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return l.last
}

// Len returns the number of live leases.
func (t *Leases) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.m)
}

// Collector returns curfew_lease_age_seconds, read from the table at scrape time.
func (t *Leases) Collector() prometheus.Collector {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "curfew_lease_age_seconds",
		Help: "Age of the oldest live decoder lease's last renewal (since the decoder's start when never renewed); 0 with no decoder. Above the lease TTL a decoder stops by itself (docs/leases.md).",
	}, func() float64 { return t.oldest(time.Now()).Seconds() })
}

// RenewLeases implements ModelProxyService: the caller's heartbeat for the decoders it
// streams from. Keys are the renewing call's tenant's: another tenant's leases are
// unknown to it.
func (s *Server) RenewLeases(ctx context.Context, req *modelproxyv1.RenewLeasesRequest) (*modelproxyv1.RenewLeasesResponse, error) {
	ttl := time.Duration(0)
	if d := req.GetTtl(); d != nil {
		if err := d.CheckValid(); err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "ttl: %v", err)
		}
		if ttl = d.AsDuration(); ttl < 0 || (ttl > 0 && ttl < MinLeaseTTL) {
			return nil, status.Errorf(codes.InvalidArgument, "ttl must be 0 (each lease's own) or at least %v, got %v", MinLeaseTTL, ttl)
		}
	}
	tenant := md.IdentityFrom(ctx).Tenant
	if tenant == "" {
		tenant = md.DefaultTenant
	}
	return &modelproxyv1.RenewLeasesResponse{Unknown: s.Leases.renew(tenant, req.GetKeys(), ttl)}, nil
}

// leaseLapsed cancels the decoder of a lapsed lease with cause lease_expired.
func (s *Server) leaseLapsed(l *lease) {
	if l.onLapse != nil {
		l.onLapse()
	}
	if s.Nodes.Cancel(l.key.run, []string{l.key.node}, cancel.ErrLeaseExpired) > 0 {
		s.log().Warn("decoder lease lapsed: its caller stopped renewing it; the decoder stops by itself",
			"tenant", l.key.tenant, "run_id", l.key.run, "node_id", l.key.node, "retry_id", l.key.retry, "ttl", l.ttl.String())
	}
}

// leaseErr turns the error of a decoder stopped by its lapsed lease into the status said
// to whoever is still listening.
func leaseErr(ctx context.Context, err error) error {
	if err != nil && errors.Is(context.Cause(ctx), cancel.ErrLeaseExpired) {
		return status.Error(codes.Canceled, "decoder lease expired: the caller stopped renewing it")
	}
	return err
}
