package retry_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

type execStream = grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]

func sendNode(ss execStream, id string) error {
	return ss.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Node{Node: &meshv1.Node{Id: id}}})
}

func sendResult(ss execStream, out string) error {
	return ss.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Result{Result: &toolrunnerv1.ExecuteResult{OutputJson: out}}})
}

// answer sends a node named after the tool and the arguments back as the result.
func answer(ss execStream, req *toolrunnerv1.ExecuteRequest) error {
	if err := sendNode(ss, "root/"+req.GetName()); err != nil {
		return err
	}
	return sendResult(ss, req.GetArgsJson())
}

// runExecute runs Execute and collects the responses until the stream ends; err is the
// stream's final error (nil on a clean end).
func runExecute(ctx context.Context, cc *grpc.ClientConn, req *toolrunnerv1.ExecuteRequest, opts ...grpc.CallOption) ([]*toolrunnerv1.ExecuteResponse, error) {
	st, err := toolrunnerv1.NewToolRunnerServiceClient(cc).Execute(ctx, req, opts...)
	if err != nil {
		return nil, err
	}
	var got []*toolrunnerv1.ExecuteResponse
	for {
		r, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return got, nil
		}
		if err != nil {
			return got, err
		}
		got = append(got, r)
	}
}

var toolReq = &toolrunnerv1.ExecuteRequest{Name: "grep", ArgsJson: `{"pattern":"curfew"}`}

func checkAnswer(t *testing.T, got []*toolrunnerv1.ExecuteResponse) {
	t.Helper()
	if len(got) != 2 || got[0].GetNode().GetId() != "root/grep" || got[1].GetResult().GetOutputJson() != toolReq.GetArgsJson() {
		t.Fatalf("responses %v, want the node and the result", got)
	}
}

func TestStreamRetriedBeforeFirstMessage(t *testing.T) {
	svc := &tools{behave: func(ss execStream, req *toolrunnerv1.ExecuteRequest, n int) error {
		if n == 1 {
			return status.Error(codes.Unavailable, "tool host restarting")
		}
		return answer(ss, req)
	}}
	reg := prometheus.NewRegistry()
	sl := &sleeper{}
	cc := dial(t, serve(t, nil, svc), retry.Config{Target: "toolrunner", Metrics: retry.NewMetrics(reg), Rand: constRand(0.5), Sleep: sl.Sleep})
	got, err := runExecute(callCtx(t), cc, toolReq)
	if err != nil {
		t.Fatalf("Execute: %v", err)
	}
	checkAnswer(t, got)
	all := svc.all()
	checkAttempts(t, all, "1", "2")
	for i, s := range all {
		if !proto.Equal(s.req, toolReq) {
			t.Errorf("attempt %d saw request %v, want %v replayed", i+1, s.req, toolReq)
		}
	}
	if w := sl.waits(); len(w) != 1 || w[0] != 12500*time.Microsecond {
		t.Errorf("waits %v, want [12.5ms]", w)
	}
	l := map[string]string{"target": "toolrunner", "method": execute}
	if n := metric(t, reg, "curfew_retry_attempts_total", with(l, "code", "Unavailable", "retry", "false")); n != 1 {
		t.Errorf("first attempt counted %v times as Unavailable", n)
	}
	if n := metric(t, reg, "curfew_retry_attempts_total", with(l, "code", "OK", "retry", "true")); n != 1 {
		t.Errorf("answering retry counted %v times as OK", n)
	}
	if n := metric(t, reg, "curfew_backoff_delay_seconds", l); n != 1 {
		t.Errorf("backoff observed %v times, want 1", n)
	}
}

func with(base map[string]string, kv ...string) map[string]string {
	out := map[string]string{}
	for k, v := range base {
		out[k] = v
	}
	for i := 0; i+1 < len(kv); i += 2 {
		out[kv[i]] = kv[i+1]
	}
	return out
}

func TestStreamNotRetriedAfterFirstMessage(t *testing.T) {
	svc := &tools{behave: func(ss execStream, _ *toolrunnerv1.ExecuteRequest, _ int) error {
		if err := sendNode(ss, "root/token-1"); err != nil {
			return err
		}
		return status.Error(codes.Unavailable, "model host died mid-stream")
	}}
	sl := &sleeper{}
	cc := dial(t, serve(t, nil, svc), retry.Config{Sleep: sl.Sleep})
	got, err := runExecute(callCtx(t), cc, toolReq)
	if len(got) != 1 || got[0].GetNode().GetId() != "root/token-1" {
		t.Fatalf("responses %v, want the one node", got)
	}
	if status.Code(err) != codes.Unavailable || retry.IsExhausted(err) {
		t.Fatalf("error %v, want the mid-stream UNAVAILABLE, unmarked", err)
	}
	checkAttempts(t, svc.all(), "1")
	if len(sl.waits()) != 0 {
		t.Fatalf("slept %v", sl.waits())
	}
}

// TestStreamRestartableAfterFirstMessage: a Restartable call whose callee dies after
// its first message starts over on a new attempt with the same retry-id and request;
// the caller is told before the new attempt's messages arrive, and gets the second
// attempt's messages whole.
func TestStreamRestartableAfterFirstMessage(t *testing.T) {
	svc := &tools{behave: func(ss execStream, req *toolrunnerv1.ExecuteRequest, n int) error {
		if n == 1 {
			if err := sendNode(ss, "root/sub/s0"); err != nil {
				return err
			}
			return status.Error(codes.Unavailable, "error reading from server: EOF")
		}
		return answer(ss, req)
	}}
	sl := &sleeper{}
	reg := prometheus.NewRegistry()
	cc := dial(t, serve(t, nil, svc), retry.Config{Target: "toolrunner", Metrics: retry.NewMetrics(reg), Sleep: sl.Sleep})
	var restarts []string
	var got []*toolrunnerv1.ExecuteResponse
	st, err := toolrunnerv1.NewToolRunnerServiceClient(cc).Execute(callCtx(t), toolReq, retry.Restartable(func(n int, err error) {
		restarts = append(restarts, fmt.Sprintf("%d %s after %d", n, status.Code(err), len(got)))
		got = nil // what the failed attempt sent is dropped
	}))
	if err != nil {
		t.Fatal(err)
	}
	for {
		r, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("Recv: %v", err)
		}
		got = append(got, r)
	}
	checkAnswer(t, got)
	if want := []string{"1 Unavailable after 1"}; !slices.Equal(restarts, want) {
		t.Fatalf("restarts %q, want %q", restarts, want)
	}
	all := svc.all()
	checkAttempts(t, all, "1", "2")
	for i, s := range all {
		if !proto.Equal(s.req, toolReq) {
			t.Errorf("attempt %d saw request %v, want %v replayed", i+1, s.req, toolReq)
		}
	}
	// Each attempt is counted once, when it answered: the cut one is not counted again.
	l := map[string]string{"target": "toolrunner", "method": execute}
	first := metric(t, reg, "curfew_retry_attempts_total", with(l, "code", "OK", "retry", "false"))
	second := metric(t, reg, "curfew_retry_attempts_total", with(l, "code", "OK", "retry", "true"))
	cut := metric(t, reg, "curfew_retry_attempts_total", with(l, "code", "Unavailable", "retry", "false"))
	if first != 1 || second != 1 || cut != 0 {
		t.Errorf("attempts counted: %v first, %v retry, %v as Unavailable; want 1, 1, 0", first, second, cut)
	}
}

// TestStreamRestartableBounded: a Restartable call still obeys the policy: attempts are
// bounded (the last error is marked exhausted), a code the policy does not retry ends it
// at once, and a side effect without an idempotency key is never run twice.
func TestStreamRestartableBounded(t *testing.T) {
	midStream := func(code codes.Code) func(execStream, *toolrunnerv1.ExecuteRequest, int) error {
		return func(ss execStream, _ *toolrunnerv1.ExecuteRequest, _ int) error {
			if err := sendNode(ss, "root/sub/s0"); err != nil {
				return err
			}
			return status.Error(code, "cut")
		}
	}
	for _, tc := range []struct {
		name     string
		code     codes.Code
		opts     []grpc.CallOption
		attempts []string
		marked   bool
	}{
		{"exhausted", codes.Unavailable, nil, []string{"1", "2", "3"}, true},
		{"not retryable", codes.Internal, nil, []string{"1"}, false},
		{"side effect without key", codes.Unavailable, []grpc.CallOption{retry.SideEffect()}, []string{"1"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			svc := &tools{behave: midStream(tc.code)}
			cc := dial(t, serve(t, nil, svc), retry.Config{Sleep: (&sleeper{}).Sleep})
			restarts := 0
			opts := append(slices.Clip(tc.opts), retry.Restartable(func(int, error) { restarts++ }))
			_, err := runExecute(callCtx(t), cc, toolReq, opts...)
			if status.Code(err) != tc.code || retry.IsExhausted(err) != tc.marked {
				t.Fatalf("error %v: want %s, marked exhausted %v", err, tc.code, tc.marked)
			}
			checkAttempts(t, svc.all(), tc.attempts...)
			if restarts != len(tc.attempts)-1 {
				t.Fatalf("%d restarts for %d attempts", restarts, len(tc.attempts))
			}
		})
	}
}

func TestStreamExhaustion(t *testing.T) {
	svc := &tools{behave: func(execStream, *toolrunnerv1.ExecuteRequest, int) error {
		return status.Error(codes.Unavailable, "down")
	}}
	sl := &sleeper{}
	cc := dial(t, serve(t, nil, svc), retry.Config{Sleep: sl.Sleep})
	got, err := runExecute(callCtx(t), cc, toolReq)
	if len(got) != 0 || status.Code(err) != codes.Unavailable || !retry.IsExhausted(err) {
		t.Fatalf("responses %v, error %v; want none and UNAVAILABLE marked exhausted", got, err)
	}
	checkAttempts(t, svc.all(), "1", "2", "3")
	if len(sl.waits()) != 2 {
		t.Fatalf("waits %v, want 2", sl.waits())
	}
}

func TestStreamNotRetryableAndDisabled(t *testing.T) {
	failing := func(c codes.Code) func(execStream, *toolrunnerv1.ExecuteRequest, int) error {
		return func(execStream, *toolrunnerv1.ExecuteRequest, int) error { return status.Error(c, "no") }
	}
	for _, tc := range []struct {
		name string
		cfg  retry.Config
		code codes.Code
	}{
		{"internal", retry.Config{}, codes.Internal},
		{"disabled", retry.Config{Default: retry.Policy{Disabled: true}}, codes.Unavailable},
		{"method disabled", retry.Config{Methods: map[string]retry.Policy{execute: {Disabled: true}}}, codes.Unavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			svc := &tools{behave: failing(tc.code)}
			tc.cfg.Sleep = (&sleeper{}).Sleep
			cc := dial(t, serve(t, nil, svc), tc.cfg)
			_, err := runExecute(callCtx(t), cc, toolReq)
			if status.Code(err) != tc.code || retry.IsExhausted(err) {
				t.Fatalf("error %v, want %v unmarked", err, tc.code)
			}
			checkAttempts(t, svc.all(), "1")
		})
	}
}

func TestStreamPushback(t *testing.T) {
	for _, tc := range []struct {
		push     string
		attempts []string
		waits    []time.Duration
	}{
		{"400", []string{"1", "2"}, []time.Duration{400 * time.Millisecond}},
		{"-1", []string{"1"}, nil},
	} {
		t.Run(tc.push, func(t *testing.T) {
			svc := &tools{behave: func(ss execStream, req *toolrunnerv1.ExecuteRequest, n int) error {
				if n == 1 {
					ss.SetTrailer(metadata.Pairs(retry.PushbackHeader, tc.push))
					return status.Error(codes.ResourceExhausted, "queue full")
				}
				return answer(ss, req)
			}}
			sl := &sleeper{}
			cc := dial(t, serve(t, nil, svc), retry.Config{Sleep: sl.Sleep})
			got, err := runExecute(callCtx(t), cc, toolReq)
			if len(tc.waits) == 0 {
				if status.Code(err) != codes.ResourceExhausted {
					t.Fatalf("error %v, want RESOURCE_EXHAUSTED", err)
				}
			} else {
				if err != nil {
					t.Fatalf("Execute: %v", err)
				}
				checkAnswer(t, got)
			}
			checkAttempts(t, svc.all(), tc.attempts...)
			w := sl.waits()
			if len(w) != len(tc.waits) || (len(w) == 1 && w[0] != tc.waits[0]) {
				t.Fatalf("waits %v, want %v", w, tc.waits)
			}
		})
	}
}

func TestStreamEmptyAnswerNotRetried(t *testing.T) {
	svc := &tools{behave: func(execStream, *toolrunnerv1.ExecuteRequest, int) error { return nil }}
	reg := prometheus.NewRegistry()
	cc := dial(t, serve(t, nil, svc), retry.Config{Metrics: retry.NewMetrics(reg), Sleep: (&sleeper{}).Sleep})
	got, err := runExecute(callCtx(t), cc, toolReq)
	if err != nil || len(got) != 0 {
		t.Fatalf("responses %v, error %v; want none, clean end", got, err)
	}
	checkAttempts(t, svc.all(), "1")
	if n := metric(t, reg, "curfew_retry_attempts_total", map[string]string{"code": "OK", "retry": "false"}); n != 1 {
		t.Fatalf("OK attempts %v, want 1", n)
	}
}

func TestStreamKeepsCallersRetryID(t *testing.T) {
	svc := &tools{behave: func(ss execStream, req *toolrunnerv1.ExecuteRequest, n int) error {
		if n == 1 {
			return status.Error(codes.Unavailable, "down")
		}
		return answer(ss, req)
	}}
	cc := dial(t, serve(t, nil, svc), retry.Config{Sleep: (&sleeper{}).Sleep})
	ctx := metadata.AppendToOutgoingContext(callCtx(t), md.RetryID, "parent-retry", md.Attempt, "3")
	got, err := runExecute(ctx, cc, toolReq)
	if err != nil {
		t.Fatal(err)
	}
	checkAnswer(t, got)
	if id := checkAttempts(t, svc.all(), "3", "4"); id != "parent-retry" {
		t.Fatalf("retry-id %q, want the caller's", id)
	}
}

// fakeStream is a client stream that answers from a script.
type fakeStream struct {
	grpc.ClientStream
	sent   []any
	closed bool
	recv   []error // RecvMsg results in order; io.EOF after
}

func (f *fakeStream) SendMsg(m any) error  { f.sent = append(f.sent, m); return nil }
func (f *fakeStream) CloseSend() error     { f.closed = true; return nil }
func (f *fakeStream) Trailer() metadata.MD { return nil }
func (f *fakeStream) RecvMsg(any) error {
	if len(f.recv) == 0 {
		return io.EOF
	}
	err := f.recv[0]
	f.recv = f.recv[1:]
	return err
}

func TestStreamOpenFailureRetried(t *testing.T) {
	var opened []metadata.MD
	var streams []*fakeStream
	streamer := func(ctx context.Context, _ *grpc.StreamDesc, _ *grpc.ClientConn, _ string, _ ...grpc.CallOption) (grpc.ClientStream, error) {
		out, _ := metadata.FromOutgoingContext(ctx)
		opened = append(opened, out)
		if len(opened) == 1 {
			return nil, status.Error(codes.Unavailable, "no connection")
		}
		if len(opened) == 2 {
			// Opens, then fails before the first message.
			s := &fakeStream{recv: []error{status.Error(codes.Unavailable, "reset")}}
			streams = append(streams, s)
			return s, nil
		}
		s := &fakeStream{recv: []error{nil}}
		streams = append(streams, s)
		return s, nil
	}
	sl := &sleeper{}
	icpt := retry.StreamClientInterceptor(retry.Config{Sleep: sl.Sleep, Logger: quiet(), Default: retry.Policy{MaxAttempts: 3}})
	cs, err := icpt(context.Background(), &grpc.StreamDesc{ServerStreams: true}, nil, execute, streamer)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	if err := cs.SendMsg("request"); err != nil {
		t.Fatal(err)
	}
	if err := cs.CloseSend(); err != nil {
		t.Fatal(err)
	}
	if err := cs.RecvMsg(nil); err != nil {
		t.Fatalf("first message: %v", err)
	}
	if err := cs.RecvMsg(nil); !errors.Is(err, io.EOF) {
		t.Fatalf("end: %v, want EOF", err)
	}
	if len(opened) != 3 || len(sl.waits()) != 2 {
		t.Fatalf("%d opens, waits %v; want 3 and 2", len(opened), sl.waits())
	}
	for i, m := range opened {
		if got := m.Get(md.Attempt); len(got) != 1 || got[0] != []string{"1", "2", "3"}[i] {
			t.Errorf("open %d: curfew-attempt %q", i+1, got)
		}
	}
	// The replacement stream got the request replayed and was half-closed like the first.
	last := streams[len(streams)-1]
	if len(last.sent) != 1 || last.sent[0] != "request" || !last.closed {
		t.Fatalf("replayed %v, closed %v; want the request and a half-close", last.sent, last.closed)
	}
}

func TestStreamClientStreamingNotRetried(t *testing.T) {
	opens := 0
	streamer := func(context.Context, *grpc.StreamDesc, *grpc.ClientConn, string, ...grpc.CallOption) (grpc.ClientStream, error) {
		opens++
		return nil, status.Error(codes.Unavailable, "no connection")
	}
	icpt := retry.StreamClientInterceptor(retry.Config{Sleep: (&sleeper{}).Sleep, Logger: quiet()})
	_, err := icpt(context.Background(), &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, nil, "/x.Y/Chat", streamer)
	if status.Code(err) != codes.Unavailable || opens != 1 {
		t.Fatalf("error %v after %d opens, want UNAVAILABLE after 1", err, opens)
	}
}
