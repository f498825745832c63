package client_test

import (
	"context"
	"net"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/curfew-mesh/curfew/client"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// attempt is what the scripted server saw of one attempt.
type attempt struct {
	method, retryID, attempt, key, auth string
}

// scripted is an orchestrator whose every attempt answers with the next error of fail (nil:
// success), recording each attempt's headers. Its Run sends a started event first when
// startFirst is set, then fails with the attempt's error.
type scripted struct {
	orchestratorv1.UnimplementedOrchestratorServiceServer
	startFirst bool

	mu       sync.Mutex
	fail     []error
	attempts []attempt
	events   []orchestratorv1.RunEvents // each Run's RunRequest.events
}

func (s *scripted) next(ctx context.Context, method string) error {
	in, _ := metadata.FromIncomingContext(ctx)
	get := func(k string) string {
		if v := in.Get(k); len(v) > 0 {
			return v[0]
		}
		return ""
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.attempts = append(s.attempts, attempt{method, get(md.RetryID), get(md.Attempt), get(md.IdempotencyKey), get("authorization")})
	if len(s.fail) == 0 {
		return nil
	}
	err := s.fail[0]
	s.fail = s.fail[1:]
	return err
}

func (s *scripted) seen() []attempt {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]attempt(nil), s.attempts...)
}

func (s *scripted) GetRun(ctx context.Context, req *orchestratorv1.GetRunRequest) (*orchestratorv1.GetRunResponse, error) {
	if err := s.next(ctx, "GetRun"); err != nil {
		return nil, err
	}
	return &orchestratorv1.GetRunResponse{Run: &orchestratorv1.Run{RunId: req.GetRunId()}}, nil
}

func (s *scripted) StartRun(ctx context.Context, _ *orchestratorv1.StartRunRequest) (*orchestratorv1.StartRunResponse, error) {
	if err := s.next(ctx, "StartRun"); err != nil {
		return nil, err
	}
	return &orchestratorv1.StartRunResponse{Run: &orchestratorv1.Run{RunId: "r1"}, Created: true}, nil
}

func (s *scripted) Run(req *orchestratorv1.RunRequest, stream orchestratorv1.OrchestratorService_RunServer) error {
	s.mu.Lock()
	s.events = append(s.events, req.GetEvents())
	s.mu.Unlock()
	err := s.next(stream.Context(), "Run")
	if s.startFirst || err == nil {
		if serr := stream.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Started{Started: &orchestratorv1.RunStarted{RunId: "r1"}}}); serr != nil {
			return serr
		}
	}
	if err != nil {
		return err
	}
	return stream.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Finished{Finished: &orchestratorv1.Run{RunId: "r1", Status: orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED}}})
}

// serve starts s on a loopback port and returns a plaintext client of it with an API key.
func serve(t *testing.T, s *scripted, opts ...client.Option) *client.Client {
	t.Helper()
	c, err := serveWith(t, s, nil, append([]client.Option{client.WithInsecure(), client.WithAPIKey("cfk_test")}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// serveWith starts s on a loopback port with srvOpts and returns New's client of it.
func serveWith(t *testing.T, s *scripted, srvOpts []grpc.ServerOption, opts ...client.Option) (*client.Client, error) {
	t.Helper()
	var lc net.ListenConfig
	l, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(srvOpts...)
	orchestratorv1.RegisterOrchestratorServiceServer(srv, s)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	c, err := client.New(l.Addr().String(), opts...)
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = c.Close() })
	return c, nil
}

var unavailable = status.Error(codes.Unavailable, "scripted: down")

// A retried call sends one retry-id, minted for the logical call, on every attempt, with
// curfew-attempt numbering them; the next logical call gets another.
func TestRetryIDStableAcrossAttempts(t *testing.T) {
	s := &scripted{fail: []error{unavailable, unavailable}}
	c := serve(t, s)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := c.Get(ctx, "r1"); err != nil {
		t.Fatalf("Get after two UNAVAILABLE attempts: %v", err)
	}
	if _, err := c.Get(ctx, "r1"); err != nil {
		t.Fatal(err)
	}
	got := s.seen()
	if len(got) != 4 {
		t.Fatalf("attempts: %+v, want 3 of the first call and 1 of the second", got)
	}
	first := got[0].retryID
	if first == "" {
		t.Fatal("no curfew-retry-id sent")
	}
	for i, a := range got[:3] {
		if a.retryID != first || a.attempt != string(rune('1'+i)) {
			t.Errorf("attempt %d: retry-id %q attempt %q, want %q and %d", i+1, a.retryID, a.attempt, first, i+1)
		}
		if a.auth != "Bearer cfk_test" {
			t.Errorf("attempt %d: authorization %q", i+1, a.auth)
		}
	}
	if got[3].retryID == first || got[3].retryID == "" || got[3].attempt != "1" {
		t.Errorf("second call: retry-id %q attempt %q, want a new id and attempt 1", got[3].retryID, got[3].attempt)
	}
}

// A Run stream is retried before its first event, but never after: the run has started.
func TestRunRetriedOnlyBeforeFirstEvent(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()

	before := &scripted{fail: []error{unavailable}}
	run, err := serve(t, before).RunAndWait(ctx, client.Request{Task: "t"})
	if err != nil || run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("Run that failed before its first event: %v, %v", run, err)
	}
	if got := before.seen(); len(got) != 2 || got[0].retryID != got[1].retryID {
		t.Errorf("attempts %+v, want 2 with one retry-id", got)
	}

	after := &scripted{startFirst: true, fail: []error{unavailable}}
	s, err := serve(t, after).Run(ctx, client.Request{Task: "t"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if ev, err := s.Next(); err != nil || ev.Kind != client.EventStarted || s.RunID() != "r1" {
		t.Fatalf("first event: %+v, %v", ev, err)
	}
	if _, err := s.Next(); status.Code(err) != codes.Unavailable {
		t.Fatalf("after the started event: %v, want UNAVAILABLE", err)
	}
	if got := after.seen(); len(got) != 1 {
		t.Errorf("attempts %+v, want 1: a Run that has started is not retried", got)
	}
}

// Run takes its deadline from ctx only: a Request.Timeout is refused before any call.
func TestRunRefusesTimeout(t *testing.T) {
	s := &scripted{}
	_, err := serve(t, s).Run(t.Context(), client.Request{Task: "t", Timeout: time.Minute})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "Request.Timeout") {
		t.Errorf("Run with a Timeout: %v, want INVALID_ARGUMENT naming Request.Timeout", err)
	}
	if got := s.seen(); len(got) != 0 {
		t.Errorf("attempts %+v, want none", got)
	}
}

// StartRun is retried only with an idempotency key, which travels on every attempt.
func TestStartRetriedOnlyWithKey(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()

	noKey := &scripted{fail: []error{unavailable}}
	if _, _, err := serve(t, noKey).Start(ctx, client.Request{Task: "t"}, ""); status.Code(err) != codes.Unavailable {
		t.Fatalf("Start without a key: %v, want UNAVAILABLE", err)
	}
	if got := noKey.seen(); len(got) != 1 {
		t.Errorf("attempts without a key: %+v, want 1", got)
	}

	withKey := &scripted{fail: []error{unavailable}}
	if _, created, err := serve(t, withKey).Start(ctx, client.Request{Task: "t"}, "job-7"); err != nil || !created {
		t.Fatalf("Start with a key: %v", err)
	}
	got := withKey.seen()
	if len(got) != 2 || got[0].retryID != got[1].retryID || got[1].key != "job-7" {
		t.Errorf("attempts with a key: %+v, want 2 with one retry-id and the key", got)
	}
}

// An error retried to exhaustion below is not retried again; RetryInfo's delay replaces
// the backoff; RESOURCE_EXHAUSTED without it is not retried.
func TestRetryHonoursExhaustionAndPushback(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()

	exhausted := &scripted{fail: []error{retry.MarkExhausted(unavailable, 3)}}
	if _, err := serve(t, exhausted).Get(ctx, "r1"); status.Code(err) != codes.Unavailable || !retry.IsExhausted(err) {
		t.Fatalf("Get: %v, want UNAVAILABLE marked RETRIES_EXHAUSTED", err)
	}
	if got := exhausted.seen(); len(got) != 1 {
		t.Errorf("attempts %+v, want 1", got)
	}

	shed, err := status.New(codes.ResourceExhausted, "scripted: shed").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(300 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	pushed := &scripted{fail: []error{shed.Err()}}
	start := time.Now()
	if _, err := serve(t, pushed).Get(ctx, "r1"); err != nil {
		t.Fatalf("Get after a pushback: %v", err)
	}
	if took := time.Since(start); took < 300*time.Millisecond {
		t.Errorf("retried after %v, before the pushed-back 300ms", took)
	}
	if got := pushed.seen(); len(got) != 2 {
		t.Errorf("attempts %+v, want 2", got)
	}

	plain := &scripted{fail: []error{status.Error(codes.ResourceExhausted, "scripted: fan-out limit")}}
	if _, err := serve(t, plain).Get(ctx, "r1"); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Get: %v, want RESOURCE_EXHAUSTED", err)
	}
	if got := plain.seen(); len(got) != 1 {
		t.Errorf("attempts %+v, want 1: no pushback, no retry", got)
	}
}

// WithoutRetries makes one attempt.
func TestWithoutRetries(t *testing.T) {
	s := &scripted{fail: []error{unavailable}}
	if _, err := serve(t, s, client.WithoutRetries()).Get(t.Context(), "r1"); status.Code(err) != codes.Unavailable {
		t.Fatalf("Get: %v, want UNAVAILABLE", err)
	}
	if got := s.seen(); len(got) != 1 || got[0].retryID == "" {
		t.Errorf("attempts %+v, want 1 with a retry-id", got)
	}
}

// RunAndWait, which reads only the summary, asks for the summary alone unless the
// request says otherwise; Run asks for what the request says (every event by default).
func TestRunAndWaitAsksForTheSummaryAlone(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	s := &scripted{}
	c := serve(t, s)
	if _, err := c.RunAndWait(ctx, client.Request{Task: "t"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RunAndWait(ctx, client.Request{Task: "t", Events: orchestratorv1.RunEvents_RUN_EVENTS_NODES}); err != nil {
		t.Fatal(err)
	}
	st, err := c.Run(ctx, client.Request{Task: "t"})
	if err != nil {
		t.Fatal(err)
	}
	st.Close()
	s.mu.Lock()
	got := slices.Clone(s.events)
	s.mu.Unlock()
	want := []orchestratorv1.RunEvents{orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY, orchestratorv1.RunEvents_RUN_EVENTS_NODES, orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED}
	if !slices.Equal(got, want) {
		t.Errorf("events asked for: %v, want %v", got, want)
	}
}
