package ollamatest

import (
	"context"
	"sync"
	"testing"
	"time"
)

// The bounds a call cancelled mid-stream must meet, from the server's side.
const (
	// RequestEndBound: after the caller cancels, ollama's access log must show the request
	// finished within this. Measured on this 2-core machine: a few milliseconds directly,
	// tens of milliseconds through the mesh; the bound leaves a wide margin.
	RequestEndBound = 2 * time.Second
	// CPUFlatBound: from CPUSettle after the request ended, the runner's CPU time may grow
	// at most this much over CPUFlatWindow. Decoding burns about one CPU-second per second,
	// so a decoder still running would show about 2 s; an idle runner shows well under a
	// millisecond. CPUSettle lets the step in progress at the cancel finish (one token
	// takes 5-10 ms here); its CPU counts towards CPUCancelToEnd.
	CPUFlatBound  = 20 * time.Millisecond
	CPUFlatWindow = 2 * time.Second
	CPUSettle     = 100 * time.Millisecond
	// MinDecodeCPU: while the stream runs, the runner must use at least this share of a CPU,
	// which shows the CPU measure can see decoding at all.
	MinDecodeCPU = 0.3
	// TokensAfterCancelBound: tokens the caller may still see after it cancelled. A chunk
	// already read from the connection when the cancel is issued is delivered (at 170
	// tokens/s one arrives every 6 ms): at most one per decoder, never a stream that goes
	// on. The runner's CPU bound above is what proves decoding stopped.
	TokensAfterCancelBound = 1

	chatPath = "POST /v1/chat/completions"
)

// CancelResult is what a call cancelled mid-stream showed, on both sides.
type CancelResult struct {
	TokensBeforeCancel int           // tokens the caller had received when it cancelled
	TokensAfterCancel  int           // tokens the caller received after it cancelled
	TokensPerSecond    float64       // the stream's rate before the cancel, at the caller
	DecodeCPU          float64       // runner CPU-seconds per second while streaming
	CallErr            error         // what the call returned
	CancelledAt        time.Time     // when the caller cancelled
	Request            Request       // the server's record of the request
	EndAfterCancel     time.Duration // Request.Ended - CancelledAt
	CPUCancelToEnd     time.Duration // runner CPU from the cancel to CPUSettle after the request's end
	CPUAfterEnd        time.Duration // runner CPU over the CPUFlatWindow that follows
}

// CancelMidStream runs call, which must start one streaming chat completion against s
// (directly or through any number of hops) and call onToken for each token it receives.
// Once 50 tokens have arrived it measures the stream for a second, cancels call's context,
// and observes the server: when its access log shows the request finished, and whether its
// runner's CPU time still grows afterwards.
func CancelMidStream(ctx context.Context, t testing.TB, s *Server, call func(ctx context.Context, onToken func()) error) CancelResult {
	t.Helper()
	var (
		mu        sync.Mutex
		tokens    int
		after     int
		cancelled bool
		reached   = make(chan struct{})
	)
	const warm = 50
	onToken := func() {
		mu.Lock()
		defer mu.Unlock()
		if cancelled {
			after++
			return
		}
		tokens++
		if tokens == warm {
			close(reached)
		}
	}
	var res CancelResult
	sentAt := time.Now()
	callCtx, callCancel := context.WithCancel(ctx)
	defer callCancel()
	callDone := make(chan error, 1)
	go func() { callDone <- call(callCtx, onToken) }()

	select {
	case <-reached:
	case err := <-callDone:
		t.Fatalf("the call ended before %d tokens: %v (%d tokens)", warm, err, tokens)
	case <-time.After(60 * time.Second):
		t.Fatalf("fewer than %d tokens within 60s", warm)
	}
	count := func() int { mu.Lock(); defer mu.Unlock(); return tokens }
	cpu := func() time.Duration {
		d, err := s.RunnerCPU()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	n0, c0, t0 := count(), cpu(), time.Now()
	time.Sleep(time.Second)
	n1, c1, t1 := count(), cpu(), time.Now()
	res.TokensPerSecond = float64(n1-n0) / t1.Sub(t0).Seconds()
	res.DecodeCPU = (c1 - c0).Seconds() / t1.Sub(t0).Seconds()

	res.CallErr = cancelAndObserve(ctx, t, s, &res, sentAt, func() {
		mu.Lock()
		cancelled = true
		res.TokensBeforeCancel = tokens
		res.CancelledAt = time.Now()
		mu.Unlock()
		callCancel()
	}, callDone)
	mu.Lock()
	res.TokensAfterCancel = after
	mu.Unlock()
	return res
}

// CancelWhileDecoding is CancelMidStream for a call whose tokens do not reach the caller
// as they are decoded (ollama holds back a completion offered tools until it ends): it
// cancels once the runner's CPU time shows it decoding (MinDecodeCPU over a second), and
// observes the server as CancelMidStream does. The result's token counts are zero.
func CancelWhileDecoding(ctx context.Context, t testing.TB, s *Server, call func(ctx context.Context) error) CancelResult {
	t.Helper()
	var res CancelResult
	sentAt := time.Now()
	callCtx, callCancel := context.WithCancel(ctx)
	defer callCancel()
	callDone := make(chan error, 1)
	go func() { callDone <- call(callCtx) }()
	for start := time.Now(); ; {
		c0, t0 := runnerCPU(t, s), time.Now()
		select {
		case err := <-callDone:
			t.Fatalf("the call ended before the server decoded for a second: %v", err)
		case <-time.After(time.Second):
		}
		res.DecodeCPU = (runnerCPU(t, s) - c0).Seconds() / time.Since(t0).Seconds()
		if res.DecodeCPU >= MinDecodeCPU {
			break
		}
		if time.Since(start) > 60*time.Second {
			t.Fatalf("the runner did not decode within 60s (%.2f CPU)", res.DecodeCPU)
		}
	}
	res.CallErr = cancelAndObserve(ctx, t, s, &res, sentAt, func() {
		res.CancelledAt = time.Now()
		callCancel()
	}, callDone)
	return res
}

func runnerCPU(t testing.TB, s *Server) time.Duration {
	t.Helper()
	d, err := s.RunnerCPU()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// cancelAndObserve cancels the call (cancel records res.CancelledAt), waits for it to
// return, and fills in res what the server shows: when the request ended, and the runner's
// CPU time after the cancel and after the end. It returns the call's error.
func cancelAndObserve(ctx context.Context, t testing.TB, s *Server, res *CancelResult, sentAt time.Time, cancel func(), callDone <-chan error) error {
	t.Helper()
	cpuCancel := runnerCPU(t, s)
	cancel()
	var callErr error
	select {
	case callErr = <-callDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the call did not return within 10s of its cancel")
	}
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	r, err := s.WaitRequest(wctx, chatPath, sentAt)
	if err != nil {
		t.Fatalf("the server did not finish the request: %v", err)
	}
	res.Request = r
	res.EndAfterCancel = r.Ended.Sub(res.CancelledAt)
	time.Sleep(time.Until(r.Ended.Add(CPUSettle)))
	cpuEnd := runnerCPU(t, s)
	res.CPUCancelToEnd = cpuEnd - cpuCancel
	time.Sleep(CPUFlatWindow)
	res.CPUAfterEnd = runnerCPU(t, s) - cpuEnd
	return callErr
}

// Check asserts the bounds and logs the figures.
func (r CancelResult) Check(t testing.TB) {
	t.Helper()
	t.Logf("before the cancel: %d tokens at %.0f tokens/s, runner at %.2f CPU", r.TokensBeforeCancel, r.TokensPerSecond, r.DecodeCPU)
	t.Logf("cancel → server request end: %v (bound %v); server handler ran %v, status %d",
		r.EndAfterCancel.Round(time.Microsecond), RequestEndBound, r.Request.Latency, r.Request.Status)
	t.Logf("runner CPU: %v from the cancel to %v after the request end, then %v in %v (bound %v); tokens after cancel at the caller: %d",
		r.CPUCancelToEnd.Round(time.Microsecond), CPUSettle, r.CPUAfterEnd.Round(time.Microsecond), CPUFlatWindow, CPUFlatBound, r.TokensAfterCancel)
	if r.DecodeCPU < MinDecodeCPU {
		t.Errorf("runner used %.2f CPU while streaming; want ≥ %.1f (is it decoding?)", r.DecodeCPU, MinDecodeCPU)
	}
	if r.EndAfterCancel > RequestEndBound {
		t.Errorf("the server finished the request %v after the cancel; want ≤ %v", r.EndAfterCancel, RequestEndBound)
	}
	if r.CPUAfterEnd > CPUFlatBound {
		t.Errorf("the runner used %v of CPU in the %v after the request ended; want ≤ %v: it is still decoding",
			r.CPUAfterEnd, CPUFlatWindow, CPUFlatBound)
	}
	if r.TokensAfterCancel > TokensAfterCancelBound {
		t.Errorf("%d tokens reached the caller after it cancelled; want ≤ %d", r.TokensAfterCancel, TokensAfterCancelBound)
	}
}
