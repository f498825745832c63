package retry_test

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/curfew-mesh/curfew/mesh/retry"
)

// almostOne is the largest float64 below 1, the top of rnd's range.
var almostOne = math.Nextafter(1, 0)

const forever = time.Duration(math.MaxInt64)

func TestPolicyWithDefaults(t *testing.T) {
	got := retry.Policy{}.WithDefaults()
	want := retry.Policy{MaxAttempts: 3, Base: 25 * time.Millisecond, Cap: 250 * time.Millisecond, MinAttemptTime: 10 * time.Millisecond}
	if got != want {
		t.Fatalf("zero policy defaults to %+v, want %+v", got, want)
	}
	set := retry.Policy{Disabled: true, MaxAttempts: 5, Base: time.Millisecond, Cap: time.Second, MinAttemptTime: time.Microsecond, NonIdempotent: true}
	if got := set.WithDefaults(); got != set {
		t.Fatalf("set fields changed: %+v, want %+v", got, set)
	}
	if err := (retry.Policy{}).WithDefaults().Validate(); err != nil {
		t.Fatalf("defaults invalid: %v", err)
	}
}

func TestPolicyValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    retry.Policy
		want string // "" for valid
	}{
		{"zero", retry.Policy{}, ""},
		{"one attempt", retry.Policy{MaxAttempts: 1}, ""},
		{"five attempts", retry.Policy{MaxAttempts: 5}, ""},
		{"six attempts", retry.Policy{MaxAttempts: 6}, "max_attempts must be between 1 and 5, got 6"},
		{"negative attempts", retry.Policy{MaxAttempts: -1}, "max_attempts"},
		{"negative base", retry.Policy{Base: -time.Millisecond}, "negative"},
		{"negative cap", retry.Policy{Cap: -time.Millisecond}, "negative"},
		{"negative min attempt time", retry.Policy{MinAttemptTime: -time.Millisecond}, "negative"},
		{"base above cap", retry.Policy{Base: time.Second, Cap: time.Millisecond}, "exceeds cap"},
		{"base equals cap", retry.Policy{Base: time.Second, Cap: time.Second}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Validate(%+v) = %v, want nil", tc.p, err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("Validate(%+v) = %v, want an error containing %q", tc.p, err, tc.want)
			}
		})
	}
}

func TestBackoffFullJitter(t *testing.T) {
	p := retry.Policy{}
	ms := time.Millisecond
	// Ceilings of attempts 2.. with the defaults: 25, 50, 100, 200, then capped at 250.
	ceilings := []time.Duration{25 * ms, 50 * ms, 100 * ms, 200 * ms, 250 * ms, 250 * ms, 250 * ms}
	for i, ceil := range ceilings {
		n := i + 2
		if d := p.Backoff(n, constRand(0)); d != 0 {
			t.Errorf("Backoff(%d, rnd=0) = %v, want 0", n, d)
		}
		top := p.Backoff(n, constRand(almostOne))
		if top >= ceil || top < ceil-time.Microsecond {
			t.Errorf("Backoff(%d, rnd→1) = %v, want just below %v", n, top, ceil)
		}
		if d, want := p.Backoff(n, constRand(0.5)), ceil/2; d != want {
			t.Errorf("Backoff(%d, rnd=0.5) = %v, want %v", n, d, want)
		}
	}
	// Ceilings grow, then stay at the cap, however far n goes (no overflow).
	prev := time.Duration(0)
	for n := 2; n <= 200; n++ {
		top := p.Backoff(n, constRand(almostOne))
		if top < prev {
			t.Fatalf("Backoff(%d) = %v fell below Backoff(%d) = %v", n, top, n-1, prev)
		}
		if top >= retry.DefaultCap || top < 0 {
			t.Fatalf("Backoff(%d) = %v, want in [0, %v)", n, top, retry.DefaultCap)
		}
		prev = top
	}
	// No wait before the first attempt.
	for _, n := range []int{-1, 0, 1} {
		if d := p.Backoff(n, constRand(almostOne)); d != 0 {
			t.Errorf("Backoff(%d) = %v, want 0", n, d)
		}
	}
	// Custom base and cap.
	q := retry.Policy{Base: 100 * ms, Cap: 300 * ms}
	for n, want := range map[int]time.Duration{2: 50 * ms, 3: 100 * ms, 4: 150 * ms, 5: 150 * ms} {
		if d := q.Backoff(n, constRand(0.5)); d != want {
			t.Errorf("custom Backoff(%d, 0.5) = %v, want %v", n, d, want)
		}
	}
}

func unavailable() error { return status.Error(codes.Unavailable, "down") }

func withRetryInfo(t *testing.T, c codes.Code, d time.Duration) error {
	t.Helper()
	st, err := status.New(c, "busy").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(d)})
	if err != nil {
		t.Fatal(err)
	}
	return st.Err()
}

func TestDecide(t *testing.T) {
	ms := time.Millisecond
	push := func(v string) metadata.MD { return metadata.Pairs(retry.PushbackHeader, v) }
	rnd := constRand(0.5)
	for _, tc := range []struct {
		name    string
		p       retry.Policy
		err     error
		trailer metadata.MD
		n       int
		left    time.Duration
		hasKey  bool
		verdict retry.Verdict
		delay   time.Duration
		reason  string
	}{
		{name: "unavailable retried", err: unavailable(), n: 1, left: forever, verdict: retry.Retry, delay: 12500 * time.Microsecond, reason: "retryable"},
		{name: "unavailable attempt 2 backs off more", err: unavailable(), n: 2, left: forever, verdict: retry.Retry, delay: 25 * ms},
		{name: "max attempts", err: unavailable(), n: 3, left: forever, verdict: retry.Exhausted, reason: "max_attempts"},
		{name: "max attempts custom", p: retry.Policy{MaxAttempts: 5}, err: unavailable(), n: 4, left: forever, verdict: retry.Retry, delay: 100 * ms},
		{name: "max attempts custom reached", p: retry.Policy{MaxAttempts: 5}, err: unavailable(), n: 5, left: forever, verdict: retry.Exhausted},
		{name: "one attempt", p: retry.Policy{MaxAttempts: 1}, err: unavailable(), n: 1, left: forever, verdict: retry.Exhausted},
		{name: "disabled", p: retry.Policy{Disabled: true}, err: unavailable(), n: 1, left: forever, verdict: retry.GiveUp, reason: "disabled"},
		{name: "resource exhausted without pushback", err: status.Error(codes.ResourceExhausted, "full"), n: 1, left: forever, verdict: retry.GiveUp, reason: "not_retryable"},
		{name: "resource exhausted with trailer pushback", err: status.Error(codes.ResourceExhausted, "full"), trailer: push("120"), n: 1, left: forever, verdict: retry.Retry, delay: 120 * ms},
		{name: "resource exhausted with RetryInfo", err: withRetryInfo(t, codes.ResourceExhausted, 300*ms), n: 1, left: forever, verdict: retry.Retry, delay: 300 * ms},
		{name: "unavailable pushback replaces backoff", err: unavailable(), trailer: push("500"), n: 1, left: forever, verdict: retry.Retry, delay: 500 * ms},
		{name: "zero pushback", err: unavailable(), trailer: push("0"), n: 1, left: forever, verdict: retry.Retry, delay: 0},
		{name: "trailer wins over RetryInfo", err: withRetryInfo(t, codes.Unavailable, 300*ms), trailer: push("40"), n: 1, left: forever, verdict: retry.Retry, delay: 40 * ms},
		{name: "negative pushback", err: unavailable(), trailer: push("-1"), n: 1, left: forever, verdict: retry.GiveUp, reason: "pushback_stop"},
		{name: "malformed pushback", err: unavailable(), trailer: push("soon"), n: 1, left: forever, verdict: retry.GiveUp, reason: "pushback_stop"},
		{name: "empty pushback", err: unavailable(), trailer: push(""), n: 1, left: forever, verdict: retry.GiveUp, reason: "pushback_stop"},
		{name: "negative RetryInfo", err: withRetryInfo(t, codes.Unavailable, -ms), n: 1, left: forever, verdict: retry.GiveUp, reason: "pushback_stop"},
		{name: "exhausted below", err: retry.MarkExhausted(unavailable(), 3), n: 1, left: forever, verdict: retry.GiveUp, reason: "retried_below"},
		{name: "non-idempotent without key", p: retry.Policy{NonIdempotent: true}, err: unavailable(), n: 1, left: forever, verdict: retry.GiveUp, reason: "side_effect_without_key"},
		{name: "non-idempotent with key", p: retry.Policy{NonIdempotent: true}, err: unavailable(), n: 1, left: forever, hasKey: true, verdict: retry.Retry, delay: 12500 * time.Microsecond},
		{name: "no time: backoff plus min attempt time past deadline", err: unavailable(), n: 1, left: 22 * ms, verdict: retry.NoTime, delay: 12500 * time.Microsecond, reason: "deadline"},
		{name: "time enough", err: unavailable(), n: 1, left: 23 * ms, verdict: retry.Retry, delay: 12500 * time.Microsecond},
		{name: "no time: pushback past deadline", err: unavailable(), trailer: push("2000"), n: 1, left: 100 * ms, verdict: retry.NoTime, delay: 2 * time.Second},
		{name: "no time: already past deadline", err: unavailable(), n: 1, left: -ms, verdict: retry.NoTime},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := tc.p.Decide(tc.err, tc.trailer, tc.n, tc.left, tc.hasKey, rnd)
			if d.Verdict != tc.verdict {
				t.Fatalf("verdict %v (%+v), want %v", d.Verdict, d, tc.verdict)
			}
			if (tc.verdict == retry.Retry || tc.delay != 0) && d.Delay != tc.delay {
				t.Errorf("delay %v, want %v", d.Delay, tc.delay)
			}
			if tc.reason != "" && d.Reason != tc.reason {
				t.Errorf("reason %q, want %q", d.Reason, tc.reason)
			}
		})
	}
}

func TestDecideOnlyRetriesUnavailable(t *testing.T) {
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		err := status.Error(c, "x")
		if c == codes.OK {
			err = status.New(c, "").Err() // nil; Decide sees OK
		}
		d := retry.Policy{}.Decide(err, nil, 1, forever, true, constRand(0))
		want := retry.GiveUp
		if c == codes.Unavailable {
			want = retry.Retry
		}
		if d.Verdict != want {
			t.Errorf("%v: verdict %v (%s), want %v", c, d.Verdict, d.Reason, want)
		}
	}
	if d := (retry.Policy{}).Decide(errors.New("plain"), nil, 1, forever, false, constRand(0)); d.Verdict != retry.GiveUp {
		t.Errorf("plain error: verdict %v, want GiveUp", d.Verdict)
	}
}

func TestPushback(t *testing.T) {
	st := status.New(codes.Unavailable, "x")
	if d, pushed, stop := retry.Pushback(st, nil); d != 0 || pushed || stop {
		t.Errorf("no pushback: %v %v %v", d, pushed, stop)
	}
	if d, pushed, stop := retry.Pushback(st, metadata.Pairs(retry.PushbackHeader, "250")); d != 250*time.Millisecond || !pushed || stop {
		t.Errorf("trailer 250: %v %v %v", d, pushed, stop)
	}
	if _, pushed, stop := retry.Pushback(st, metadata.Pairs(retry.PushbackHeader, "-5")); pushed || !stop {
		t.Errorf("trailer -5: pushed %v stop %v, want stop", pushed, stop)
	}
	if _, pushed, stop := retry.Pushback(st, metadata.Pairs(retry.PushbackHeader, "1.5")); pushed || !stop {
		t.Errorf("trailer 1.5: pushed %v stop %v, want stop", pushed, stop)
	}
	ri := status.Convert(withRetryInfo(t, codes.Unavailable, 75*time.Millisecond))
	if d, pushed, stop := retry.Pushback(ri, nil); d != 75*time.Millisecond || !pushed || stop {
		t.Errorf("RetryInfo 75ms: %v %v %v", d, pushed, stop)
	}
	// A RetryInfo without a delay is no pushback.
	empty, err := status.New(codes.Unavailable, "x").WithDetails(&errdetails.RetryInfo{})
	if err != nil {
		t.Fatal(err)
	}
	if d, pushed, stop := retry.Pushback(empty, nil); d != 0 || pushed || stop {
		t.Errorf("empty RetryInfo: %v %v %v", d, pushed, stop)
	}
}

func TestMarkExhaustedKeepsStatus(t *testing.T) {
	debug := &errdetails.DebugInfo{Detail: "backend 7"}
	ri := &errdetails.RetryInfo{RetryDelay: durationpb.New(time.Second)}
	st, err := status.New(codes.Unavailable, "backend down").WithDetails(debug, ri)
	if err != nil {
		t.Fatal(err)
	}
	if retry.IsExhausted(st.Err()) {
		t.Fatal("unmarked error reads as exhausted")
	}
	marked := retry.MarkExhausted(st.Err(), 3)
	if !retry.IsExhausted(marked) {
		t.Fatal("marked error does not read as exhausted")
	}
	got := status.Convert(marked)
	if got.Code() != codes.Unavailable || got.Message() != "backend down" {
		t.Fatalf("marked status %v %q, want UNAVAILABLE %q", got.Code(), got.Message(), "backend down")
	}
	details := got.Details()
	if len(details) != 3 {
		t.Fatalf("details %v, want the 2 originals and the marker", details)
	}
	if d, ok := details[0].(*errdetails.DebugInfo); !ok || !proto.Equal(d, debug) {
		t.Errorf("detail 0 = %v, want %v", details[0], debug)
	}
	if d, ok := details[1].(*errdetails.RetryInfo); !ok || !proto.Equal(d, ri) {
		t.Errorf("detail 1 = %v, want %v", details[1], ri)
	}
	ei, ok := details[2].(*errdetails.ErrorInfo)
	if !ok || ei.GetReason() != retry.ExhaustedReason || ei.GetDomain() != retry.ExhaustedDomain || ei.GetMetadata()["attempts"] != "3" {
		t.Errorf("marker = %v", details[2])
	}
	// Marking twice adds no second marker.
	again := retry.MarkExhausted(marked, 5)
	if n := len(status.Convert(again).Details()); n != 3 {
		t.Errorf("marked twice: %d details, want 3", n)
	}
	// Pushback from the kept RetryInfo still reads after marking.
	if d, pushed, _ := retry.Pushback(got, nil); !pushed || d != time.Second {
		t.Errorf("pushback after marking: %v %v", d, pushed)
	}
}

func TestMarkExhaustedEdgeCases(t *testing.T) {
	if err := retry.MarkExhausted(nil, 1); err != nil {
		t.Errorf("MarkExhausted(nil) = %v, want nil", err)
	}
	if retry.IsExhausted(nil) {
		t.Error("IsExhausted(nil)")
	}
	plain := retry.MarkExhausted(errors.New("boom"), 2)
	if !retry.IsExhausted(plain) || status.Code(plain) != codes.Unknown || status.Convert(plain).Message() != "boom" {
		t.Errorf("plain error marked as %v", plain)
	}
	// An ErrorInfo of another domain or reason is not the marker.
	for _, ei := range []*errdetails.ErrorInfo{
		{Reason: retry.ExhaustedReason, Domain: "example.com"},
		{Reason: "OTHER", Domain: retry.ExhaustedDomain},
	} {
		st, err := status.New(codes.Unavailable, "x").WithDetails(ei)
		if err != nil {
			t.Fatal(err)
		}
		if retry.IsExhausted(st.Err()) {
			t.Errorf("%v reads as exhausted", ei)
		}
	}
}
