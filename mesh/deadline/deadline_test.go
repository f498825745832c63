package deadline_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/deadline"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestApply(t *testing.T) {
	now := time.Now()
	p := deadline.Policy{Default: 2 * time.Second, Max: time.Minute}
	cases := []struct {
		name     string
		ctxDL    time.Duration // 0: no deadline
		want     time.Duration // from now
		assigned bool
		capped   bool
	}{
		{"no deadline gets the default", 0, 2 * time.Second, true, false},
		{"beyond max is capped", time.Hour, time.Minute, false, true},
		{"exactly max is kept", time.Minute, time.Minute, false, false},
		{"short deadline stays", 100 * time.Millisecond, 100 * time.Millisecond, false, false},
		{"shorter than default stays", time.Second, time.Second, false, false},
		{"between default and max stays", 30 * time.Second, 30 * time.Second, false, false},
		{"already past stays", -time.Second, -time.Second, false, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			parent := context.Background()
			if tc.ctxDL != 0 {
				var cancel context.CancelFunc
				parent, cancel = context.WithDeadline(parent, now.Add(tc.ctxDL))
				defer cancel()
			}
			ctx, cancel, info := p.Apply(parent, now)
			defer cancel()
			want := now.Add(tc.want)
			dl, ok := ctx.Deadline()
			if !ok || !dl.Equal(want) {
				t.Errorf("ctx deadline = %v (ok=%v), want now+%v", dl.Sub(now), ok, tc.want)
			}
			if !info.Deadline.Equal(want) || info.Assigned != tc.assigned || info.Capped != tc.capped {
				t.Errorf("info = {%v assigned=%v capped=%v}, want {now+%v %v %v}",
					info.Deadline.Sub(now), info.Assigned, info.Capped, tc.want, tc.assigned, tc.capped)
			}
		})
	}
}

func TestApplyZeroPolicyUsesDefaults(t *testing.T) {
	now := time.Now()
	var p deadline.Policy
	ctx, cancel, info := p.Apply(context.Background(), now)
	defer cancel()
	if dl, _ := ctx.Deadline(); !dl.Equal(now.Add(deadline.DefaultTimeout)) || !info.Assigned {
		t.Errorf("zero policy, no deadline: got now+%v, want now+%v", dl.Sub(now), deadline.DefaultTimeout)
	}
	far, cancelFar := context.WithDeadline(context.Background(), now.Add(24*time.Hour))
	defer cancelFar()
	ctx, cancel2, info := p.Apply(far, now)
	defer cancel2()
	if dl, _ := ctx.Deadline(); !dl.Equal(now.Add(deadline.DefaultMax)) || !info.Capped {
		t.Errorf("zero policy, 24h deadline: got now+%v, want now+%v", dl.Sub(now), deadline.DefaultMax)
	}
	if p.MaxTimeout() != deadline.DefaultMax {
		t.Errorf("MaxTimeout = %v", p.MaxTimeout())
	}
}

func TestApplyDefaultNeverExceedsMax(t *testing.T) {
	now := time.Now()
	p := deadline.Policy{Max: time.Second} // Default unset: DefaultTimeout (30s) > Max
	ctx, cancel, info := p.Apply(context.Background(), now)
	defer cancel()
	if dl, _ := ctx.Deadline(); !dl.Equal(now.Add(time.Second)) || !info.Assigned {
		t.Errorf("no deadline under Max 1s: got now+%v (assigned=%v), want now+1s", dl.Sub(now), info.Assigned)
	}
}

func TestApplyKeepsParentCancellation(t *testing.T) {
	parent, cancelParent := context.WithCancel(context.Background())
	ctx, cancel, _ := deadline.Policy{}.Apply(parent, time.Now())
	defer cancel()
	cancelParent()
	select {
	case <-ctx.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("cancelling the parent did not cancel the applied context")
	}
}

func TestValidate(t *testing.T) {
	cases := []struct {
		p       deadline.Policy
		wantErr string
	}{
		{deadline.Policy{}, ""},
		{deadline.Policy{Default: time.Second, Max: time.Second}, ""},
		{deadline.Policy{Default: time.Minute, Max: time.Second}, "exceeds max"},
		{deadline.Policy{Max: time.Second}, ""}, // the default default is capped at Max
		{deadline.Policy{Default: 2 * time.Minute}, ""},
		{deadline.Policy{Default: 11 * time.Minute}, "exceeds max"}, // above DefaultMax
		{deadline.Policy{Default: -time.Second}, "negative"},
		{deadline.Policy{Max: -time.Second}, "negative"},
	}
	for _, tc := range cases {
		err := tc.p.Validate()
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%+v: unexpected error %v", tc.p, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%+v: error %v, want one containing %q", tc.p, err, tc.wantErr)
		}
	}
}

func TestCheck(t *testing.T) {
	t.Run("enough time", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := deadline.Check(ctx, time.Second, "tool sleep"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("no deadline", func(t *testing.T) {
		if err := deadline.Check(context.Background(), time.Hour, "tool sleep"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("too little left", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		err := deadline.Check(ctx, time.Minute, "tool sleep")
		if status.Code(err) != codes.DeadlineExceeded || !strings.HasPrefix(status.Convert(err).Message(), "no time left to start tool sleep") {
			t.Fatalf("got %v, want DEADLINE_EXCEEDED \"no time left to start tool sleep...\"", err)
		}
	})
	t.Run("expired", func(t *testing.T) {
		ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Millisecond))
		defer cancel()
		err := deadline.Check(ctx, 0, "model call root/m0")
		if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(status.Convert(err).Message(), "no time left to start model call root/m0") {
			t.Fatalf("got %v, want DEADLINE_EXCEEDED \"no time left to start model call root/m0\"", err)
		}
	})
	t.Run("cancelled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		if err := deadline.Check(ctx, 0, "x"); status.Code(err) != codes.Canceled {
			t.Fatalf("got %v, want CANCELED", err)
		}
	})
}

func TestRemaining(t *testing.T) {
	now := time.Now()
	ctx, cancel := context.WithDeadline(context.Background(), now.Add(1500*time.Millisecond))
	defer cancel()
	if got := deadline.Remaining(ctx, now); got != 1500*time.Millisecond {
		t.Errorf("Remaining = %v, want 1.5s", got)
	}
	if got := deadline.Remaining(ctx, now.Add(2*time.Second)); got != -500*time.Millisecond {
		t.Errorf("Remaining after the deadline = %v, want -500ms", got)
	}
	if got := deadline.Remaining(context.Background(), now); got < 100*365*24*time.Hour {
		t.Errorf("Remaining without deadline = %v, want very large", got)
	}
}

func TestReconcile(t *testing.T) {
	now := time.Now()
	grpcDL := now.Add(10 * time.Second)
	withDL, stop := context.WithDeadline(context.Background(), grpcDL)
	defer stop()
	const tol = time.Second
	cases := []struct {
		name string
		ctx  context.Context
		abs  time.Time
		want time.Time // zero: no deadline
		skew time.Duration
	}{
		{"no grpc deadline", context.Background(), now, time.Time{}, 0},
		{"no absolute deadline", withDL, time.Time{}, grpcDL, 0},
		{"absolute later: keep the earlier grpc one", withDL, grpcDL.Add(time.Second), grpcDL, 0},
		{"equal", withDL, grpcDL, grpcDL, 0},
		{"transit delay: shorten to absolute", withDL, grpcDL.Add(-200 * time.Millisecond), grpcDL.Add(-200 * time.Millisecond), 0},
		{"at the tolerance", withDL, grpcDL.Add(-tol), grpcDL.Add(-tol), 0},
		{"beyond: skew, keep grpc", withDL, grpcDL.Add(-5 * time.Second), grpcDL, 5 * time.Second},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel, skew := deadline.Reconcile(tc.ctx, tc.abs, tol)
			defer cancel()
			dl, ok := ctx.Deadline()
			if ok != !tc.want.IsZero() || (ok && !dl.Equal(tc.want)) {
				t.Errorf("deadline = %v (ok=%v), want %v", dl, ok, tc.want)
			}
			if skew != tc.skew {
				t.Errorf("skew = %v, want %v", skew, tc.skew)
			}
		})
	}
}
