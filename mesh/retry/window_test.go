package retry_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/retry"
)

// window is a retry.Window that allows the first allow calls and refuses the others,
// recording the targets asked for.
type window struct {
	mu      sync.Mutex
	allow   int
	targets []string
}

var errNoWindow = errors.New("no window")

func (w *window) AllowRetry(_ context.Context, target string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.targets = append(w.targets, target)
	if len(w.targets) > w.allow {
		return errNoWindow
	}
	return nil
}

func (w *window) asked() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.targets...)
}

// TestWindowNotAskedOnSuccess: a call that succeeds at once never asks the window
// (coordination costs nothing while nothing fails).
func TestWindowNotAskedOnSuccess(t *testing.T) {
	svc := &nodes{}
	w := &window{}
	cc := dial(t, serve(t, svc, nil), retry.Config{Target: "nodes", Window: w, Sleep: (&sleeper{}).Sleep})
	for range 5 {
		if err := listNodesCall(callCtx(t), cc); err != nil {
			t.Fatal(err)
		}
	}
	if got := w.asked(); len(got) != 0 {
		t.Fatalf("window asked %v on the success path", got)
	}
}

// TestWindowRefusalEndsCall: without a window, and with a refusal that does not say when
// the window moves, the first retryable error ends the call, marked exhausted (no layer
// above retries it), after one attempt.
func TestWindowRefusalEndsCall(t *testing.T) {
	svc := &nodes{fail: failFirst(5, status.Error(codes.Unavailable, "down"))}
	w := &window{}
	cc := dial(t, serve(t, svc, nil), retry.Config{Target: "nodes", Window: w, Sleep: (&sleeper{}).Sleep})
	err := listNodesCall(callCtx(t), cc)
	checkAttempts(t, svc.all(), "1")
	if status.Code(err) != codes.Unavailable || !retry.IsExhausted(err) {
		t.Fatalf("error %v: want UNAVAILABLE marked exhausted", err)
	}
	if got := w.asked(); len(got) != 1 || got[0] != "nodes" {
		t.Fatalf("window asked %v, want once for nodes", got)
	}
}

// TestWindowHeldRetries: with the window, retries go on as without one; it is asked
// before the backoff and again after it, for each retry.
func TestWindowHeldRetries(t *testing.T) {
	svc := &nodes{fail: failFirst(2, status.Error(codes.Unavailable, "warming up"))}
	w := &window{allow: 100}
	cc := dial(t, serve(t, svc, nil), retry.Config{Target: "nodes", Window: w, Sleep: (&sleeper{}).Sleep})
	if err := listNodesCall(callCtx(t), cc); err != nil {
		t.Fatal(err)
	}
	checkAttempts(t, svc.all(), "1", "2", "3")
	if got := len(w.asked()); got != 4 {
		t.Fatalf("window asked %d times for 2 retries, want 4", got)
	}
}

// TestWindowEndsDuringBackoff: a window that ends during the backoff stops the retry
// before it is sent.
func TestWindowEndsDuringBackoff(t *testing.T) {
	svc := &nodes{fail: failFirst(5, status.Error(codes.Unavailable, "down"))}
	w := &window{allow: 1}
	cc := dial(t, serve(t, svc, nil), retry.Config{Target: "nodes", Window: w, Sleep: (&sleeper{}).Sleep})
	if err := listNodesCall(callCtx(t), cc); !retry.IsExhausted(err) {
		t.Fatalf("error %v not marked exhausted", err)
	}
	checkAttempts(t, svc.all(), "1")
}

// movingWindow refuses the first refusals asks, each refusal saying the window moves
// in `in`, then allows every retry.
type movingWindow struct {
	mu       sync.Mutex
	refusals int
	in       time.Duration
	asked    int
}

type refusal struct{ at time.Time }

func (r refusal) Error() string      { return "another replica holds the window" }
func (r refusal) RetryAt() time.Time { return r.at }

func (w *movingWindow) AllowRetry(context.Context, string) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.asked++
	if w.asked <= w.refusals {
		return refusal{at: time.Now().Add(w.in)}
	}
	return nil
}

// TestWindowRefusalWaited: a refusal that says when the window moves is waited out
// (others wait, seed 001) and the retry is sent then; more than MaxWindowWaits refusals
// in a row, or a move the deadline leaves no room for, end the call marked exhausted.
func TestWindowRefusalWaited(t *testing.T) {
	for _, tc := range []struct {
		name     string
		w        *movingWindow
		timeout  time.Duration
		attempts []string
		waits    int // window waits slept (backoffs apart)
	}{
		{"moves", &movingWindow{refusals: 2, in: 2 * time.Second}, 20 * time.Second, []string{"1", "2"}, 2},
		{"too many refusals", &movingWindow{refusals: 100, in: 2 * time.Second}, 20 * time.Second, []string{"1"}, retry.MaxWindowWaits},
		{"past the deadline", &movingWindow{refusals: 1, in: 30 * time.Second}, 20 * time.Second, []string{"1"}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			svc := &nodes{fail: failFirst(1, status.Error(codes.Unavailable, "cut"))}
			sl := &sleeper{}
			cc := dial(t, serve(t, svc, nil), retry.Config{Target: "nodes", Window: tc.w, Sleep: sl.Sleep, Rand: constRand(0)})
			ctx, cancel := context.WithTimeout(t.Context(), tc.timeout)
			defer cancel()
			err := listNodesCall(ctx, cc)
			checkAttempts(t, svc.all(), tc.attempts...)
			if ok := len(tc.attempts) > 1; ok != (err == nil) || (!ok && !retry.IsExhausted(err)) {
				t.Fatalf("error %v with %d attempts", err, len(tc.attempts))
			}
			waits := 0
			for _, d := range sl.waits() {
				if d > time.Second { // a window wait (about 2 s), not a backoff (≤ 250 ms)
					waits++
				}
			}
			if waits != tc.waits {
				t.Fatalf("waited %d times for the window (sleeps %v), want %d", waits, sl.waits(), tc.waits)
			}
		})
	}
}

// TestWindowNotForNaive: the naive baseline coordinates nothing.
func TestWindowNotForNaive(t *testing.T) {
	svc := &nodes{fail: failFirst(2, status.Error(codes.Unavailable, "down"))}
	w := &window{}
	cc := dial(t, serve(t, svc, nil), retry.Config{Target: "nodes", Window: w, Default: retry.Policy{Naive: true},
		Sleep: (&sleeper{}).Sleep})
	if err := listNodesCall(callCtx(t), cc); err != nil {
		t.Fatal(err)
	}
	if got := w.asked(); len(got) != 0 {
		t.Fatalf("window asked %v by the naive policy", got)
	}
}

// TestFileWindow: the file's window section, its defaults and its bounds.
func TestFileWindow(t *testing.T) {
	f, err := retry.DecodeFile([]byte(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	if w := f.RetryWindow(); w.Off || w.Replicas != retry.DefaultWindowReplicas || w.Length != retry.DefaultWindowLength {
		t.Fatalf("defaults %+v", w)
	}
	f, err = retry.DecodeFile([]byte(`{"window": {"replicas": 2, "length": "3s"}}`))
	if err != nil {
		t.Fatal(err)
	}
	if w := f.RetryWindow(); w.Off || w.Replicas != 2 || w.Length.String() != "3s" {
		t.Fatalf("set %+v", w)
	}
	f, err = retry.DecodeFile([]byte(`{"window": {"disabled": true, "replicas": 0}}`))
	if err != nil || !f.RetryWindow().Off {
		t.Fatalf("disabled: %v %+v", err, f)
	}
	if f, err = retry.DecodeFile([]byte(`{"naive": true}`)); err != nil || !f.RetryWindow().Off {
		t.Fatalf("naive: %v", err)
	}
	for _, bad := range []string{`{"window": {"replicas": 0}}`, `{"window": {"length": "10ms"}}`, `{"window": {"every": "1s"}}`} {
		if _, err := retry.DecodeFile([]byte(bad)); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}

// TestFlagsWindowCoordination: --retry-coordination=off turns the windows off whatever the
// file says, store (the default) leaves them as the file says, and another value is
// refused.
func TestFlagsWindowCoordination(t *testing.T) {
	file := []byte(`{"window": {"replicas": 2}}`)
	for _, c := range []struct {
		coordination string
		off          bool
	}{{"", false}, {retry.CoordinationStore, false}, {retry.CoordinationOff, true}} {
		fl := retry.Flags{File: "retry.json", Coordination: c.coordination}
		f, err := fl.Decode(file, nil)
		if err != nil {
			t.Fatalf("%q: %v", c.coordination, err)
		}
		if w := f.RetryWindow(); w.Off != c.off || (!w.Off && w.Replicas != 2) {
			t.Errorf("--retry-coordination=%q: window %+v, want off %v", c.coordination, w, c.off)
		}
	}
	fl := retry.Flags{File: "retry.json", Coordination: "leader"}
	if _, err := fl.Decode(file, nil); err == nil || !strings.Contains(err.Error(), "--retry-coordination") {
		t.Fatalf("--retry-coordination=leader: %v, want it refused", err)
	}
}
