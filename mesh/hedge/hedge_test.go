package hedge_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/hedge"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// long bounds waits that only a broken implementation exhausts.
const long = 10 * time.Second

func newPolicy(t *testing.T, cfg hedge.Config) (*hedge.Policy, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg.Metrics = hedge.NewMetrics(reg)
	p, err := hedge.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p, reg
}

// warm observes n latencies of tool: i ms for i in 1..n.
func warm(p *hedge.Policy, tool string, n int) {
	for i := 1; i <= n; i++ {
		p.Observe(tool, time.Duration(i)*time.Millisecond)
	}
}

func count(t *testing.T, reg *prometheus.Registry, name, tool string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "tool" && l.GetValue() == tool {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func TestConfig(t *testing.T) {
	if p, err := hedge.New(hedge.Config{}); p != nil || err != nil {
		t.Fatalf("zero config: %v, %v; want hedging off (nil, nil)", p, err)
	}
	for _, c := range []hedge.Config{{MaxExtraLoad: -0.1}, {MaxExtraLoad: 0.6}, {MaxExtraLoad: 0.05, MinSamples: 300},
		{MaxExtraLoad: 0.05, Window: 10}, {MaxExtraLoad: 0.05, Window: -1}} {
		if _, err := hedge.New(c); err == nil {
			t.Errorf("%+v accepted", c)
		}
	}
}

// The delay is the (1 − MaxExtraLoad) quantile of the tool's last Window latencies,
// and there is none before MinSamples of them.
func TestDelayIsTheQuantileAfterMinSamples(t *testing.T) {
	p, _ := newPolicy(t, hedge.Config{MaxExtraLoad: 0.05, Window: 100, MinSamples: 20})
	warm(p, "read", 19)
	if _, ok := p.Delay("read"); ok {
		t.Fatal("a delay with 19 of 20 samples")
	}
	warm(p, "read", 100) // the ring now holds 1..100 ms
	if d, ok := p.Delay("read"); !ok || d != 95*time.Millisecond {
		t.Fatalf("delay %v %v, want the p95, 95ms", d, ok)
	}
	if _, ok := p.Delay("other"); ok {
		t.Fatal("a tool never seen has a delay")
	}
	// The ring forgets: 100 calls of 10 ms replace them all.
	for range 100 {
		p.Observe("read", 10*time.Millisecond)
	}
	if d, _ := p.Delay("read"); d != 10*time.Millisecond {
		t.Fatalf("delay %v after the window turned over, want 10ms", d)
	}
	var off *hedge.Policy
	if _, ok := off.Delay("read"); ok {
		t.Fatal("a nil policy hedges")
	}
}

// A slow primary gets one backup after the delay; the backup wins and the primary is
// cancelled with cause superseded.
func TestBackupWinsAndSupersedesThePrimary(t *testing.T) {
	p, reg := newPolicy(t, hedge.Config{MaxExtraLoad: 0.05, MinSamples: 20})
	warm(p, "read", 20) // p95: 19 ms
	var primaryCause atomic.Value
	var backups atomic.Int32
	start := time.Now()
	out, err := p.Do(t.Context(), "read", 0, func(ctx context.Context, backup bool) (string, error) {
		if backup {
			backups.Add(1)
			return "backup", nil
		}
		select {
		case <-ctx.Done():
			primaryCause.Store(context.Cause(ctx))
			return "", status.FromContextError(ctx.Err()).Err()
		case <-time.After(long):
			return "primary", nil
		}
	})
	if err != nil || out != "backup" {
		t.Fatalf("Do: %q, %v; want the backup's answer", out, err)
	}
	if el := time.Since(start); el < 19*time.Millisecond || el > long/2 {
		t.Fatalf("answered after %v: want after the 19ms delay, long before the primary", el)
	}
	if c, _ := primaryCause.Load().(error); !errors.Is(c, cancel.ErrSuperseded) {
		t.Fatalf("primary's cause %v, want superseded", c)
	}
	if backups.Load() != 1 {
		t.Fatalf("%d backups, want 1", backups.Load())
	}
	if s, w := count(t, reg, "curfew_hedges_sent_total", "read"), count(t, reg, "curfew_hedges_won_total", "read"); s != 1 || w != 1 {
		t.Fatalf("sent %v won %v, want 1 and 1", s, w)
	}
	// The superseded primary was recorded at the delay, not at its elapsed time (which
	// would raise the next delay) nor left out.
	if d, _ := p.Delay("read"); d != 19*time.Millisecond {
		t.Fatalf("delay %v after a backup won, want it kept at 19ms", d)
	}
}

// A primary that answers first cancels its backup with cause superseded.
func TestPrimaryWinsAndSupersedesTheBackup(t *testing.T) {
	p, reg := newPolicy(t, hedge.Config{MaxExtraLoad: 0.05, MinSamples: 20})
	warm(p, "read", 20)
	backupStarted := make(chan struct{})
	var backupCause atomic.Value
	out, err := p.Do(t.Context(), "read", 0, func(ctx context.Context, backup bool) (string, error) {
		if backup {
			close(backupStarted)
			<-ctx.Done()
			backupCause.Store(context.Cause(ctx))
			return "", status.FromContextError(ctx.Err()).Err()
		}
		select {
		case <-backupStarted:
		case <-time.After(long):
		}
		return "primary", nil
	})
	if err != nil || out != "primary" {
		t.Fatalf("Do: %q, %v", out, err)
	}
	if c, _ := backupCause.Load().(error); !errors.Is(c, cancel.ErrSuperseded) {
		t.Fatalf("backup's cause %v, want superseded", c)
	}
	if s, w := count(t, reg, "curfew_hedges_sent_total", "read"), count(t, reg, "curfew_hedges_won_total", "read"); s != 1 || w != 0 {
		t.Fatalf("sent %v won %v, want 1 and 0", s, w)
	}
}

// A backup the retry budget refuses is counted and leaves the primary to finish.
func TestRefusedBackupLeavesThePrimary(t *testing.T) {
	p, reg := newPolicy(t, hedge.Config{MaxExtraLoad: 0.05, MinSamples: 20})
	warm(p, "read", 20)
	refused := make(chan struct{})
	out, err := p.Do(t.Context(), "read", 0, func(ctx context.Context, backup bool) (string, error) {
		if backup {
			defer close(refused)
			// What the retry interceptor answers a retry.Hedge call the budget refuses.
			return "", refusal(t)
		}
		select {
		case <-refused:
		case <-time.After(long):
		}
		return "primary", ctx.Err()
	})
	if err != nil || out != "primary" {
		t.Fatalf("Do: %q, %v", out, err)
	}
	if r, s := count(t, reg, "curfew_hedges_refused_total", "read"), count(t, reg, "curfew_hedges_sent_total", "read"); r != 1 || s != 0 {
		t.Fatalf("refused %v sent %v, want 1 and 0", r, s)
	}
}

// refusal is the retry layer's own refusal of a backup: a budget without a floor and
// without requests refuses every retry.
func refusal(t *testing.T) error {
	t.Helper()
	return retry.ErrHedgeRefused
}

// No backup with less time left than the caller's minimum, nor before MinSamples.
func TestNoBackupWithoutTimeOrSamples(t *testing.T) {
	p, reg := newPolicy(t, hedge.Config{MaxExtraLoad: 0.05, MinSamples: 20})
	var backups atomic.Int32
	slow := func(ctx context.Context, backup bool) (string, error) {
		if backup {
			backups.Add(1)
			return "backup", nil
		}
		time.Sleep(60 * time.Millisecond)
		return "primary", nil
	}
	if out, _ := p.Do(t.Context(), "cold", 0, slow); out != "primary" || backups.Load() != 0 {
		t.Fatalf("a tool without samples got a backup (%q)", out)
	}
	warm(p, "read", 20)
	ctx, cancelCtx := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancelCtx()
	if out, _ := p.Do(ctx, "read", 5*time.Second, slow); out != "primary" || backups.Load() != 0 {
		t.Fatalf("a backup with less time left than the minimum (%q)", out)
	}
	if s := count(t, reg, "curfew_hedges_sent_total", "read"); s != 0 {
		t.Fatalf("sent %v", s)
	}
}

// When both fail, the primary's error is returned; when the primary fails before its
// delay, no backup is sent.
func TestFailures(t *testing.T) {
	p, _ := newPolicy(t, hedge.Config{MaxExtraLoad: 0.05, MinSamples: 20})
	warm(p, "read", 20)
	var backups atomic.Int32
	_, err := p.Do(t.Context(), "read", 0, func(ctx context.Context, backup bool) (string, error) {
		if backup {
			backups.Add(1)
		}
		return "", status.Error(codes.NotFound, "primary fails at once")
	})
	if status.Code(err) != codes.NotFound || backups.Load() != 0 {
		t.Fatalf("fast failure: %v with %d backups, want NOT_FOUND and none", err, backups.Load())
	}
	_, err = p.Do(t.Context(), "read", 0, func(ctx context.Context, backup bool) (string, error) {
		if backup {
			return "", status.Error(codes.Unavailable, "backup")
		}
		time.Sleep(60 * time.Millisecond)
		return "", status.Error(codes.Internal, "primary")
	})
	if status.Code(err) != codes.Internal {
		t.Fatalf("both failed: %v, want the primary's INTERNAL", err)
	}
	// The primary fails after the backup was sent: the backup's success wins.
	out, err := p.Do(t.Context(), "read", 0, func(ctx context.Context, backup bool) (string, error) {
		if backup {
			time.Sleep(60 * time.Millisecond)
			return "backup", nil
		}
		time.Sleep(40 * time.Millisecond)
		return "", status.Error(codes.Unavailable, "primary")
	})
	if err != nil || out != "backup" {
		t.Fatalf("primary failed, backup succeeded: %q, %v", out, err)
	}
}

// Calls at the median keep the ring below the delay: a fraction of calls near
// MaxExtraLoad gets backups, not more.
func TestExtraLoadStaysNearMaxExtraLoad(t *testing.T) {
	if testing.Short() {
		t.Skip("timing")
	}
	p, reg := newPolicy(t, hedge.Config{MaxExtraLoad: 0.1, Window: 100, MinSamples: 20})
	// 10 % of the calls take 40 ms, the rest 1 ms: the p90 is 1 ms... so every slow call,
	// and only those, get a backup, which answers in 1 ms.
	for i := range 100 {
		slow := i%10 == 9
		_, _ = p.Do(t.Context(), "read", 0, func(ctx context.Context, backup bool) (string, error) {
			if slow && !backup {
				select {
				case <-ctx.Done():
				case <-time.After(40 * time.Millisecond):
				}
				return "slow", nil
			}
			time.Sleep(time.Millisecond)
			return "fast", nil
		})
	}
	// (By construction about 10 of 80 hedgeable calls exceed the p90; the margin is for
	// a loaded machine's jitter on the 1 ms calls.)
	s := count(t, reg, "curfew_hedges_sent_total", "read")
	t.Logf("%v backups sent for 100 calls (80 after MinSamples) at max_extra_load 0.1", s)
	if s > 30 {
		t.Fatalf("%v backups for 100 calls at max_extra_load 0.1, want about 10", s)
	}
}
