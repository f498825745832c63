package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/client"
	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// slowPlan runs until it is cancelled or its deadline passes.
const slowPlan = `{"steps": [{"tools": [{"name": "sleep", "args": {"ms": 120000}}]}, {"answer_tokens": 5}]}`

func newClient(t *testing.T, opts ...client.Option) *client.Client {
	t.Helper()
	c, err := client.New(orchestratorAddr, append([]client.Option{client.WithInsecure(), client.WithAPIKey(apiKey)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// The ctx's deadline is the run's absolute deadline.
func TestRunDeadlineIsCtxDeadline(t *testing.T) {
	c := newClient(t)
	ctx, cancel := context.WithTimeout(t.Context(), 45*time.Second)
	defer cancel()
	want, _ := ctx.Deadline()
	s, err := c.Run(ctx, client.Request{Task: slowPlan})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ev, err := s.Next()
	if err != nil || ev.Kind != client.EventStarted {
		t.Fatalf("first event: %+v, %v", ev, err)
	}
	got := ev.Started.GetDeadline().AsTime()
	// The server reads the relative grpc-timeout on arrival, so its deadline is at most the
	// ctx's (same clock) and short of it only by the call's transit.
	if got.After(want.Add(5*time.Millisecond)) || got.Before(want.Add(-5*time.Second)) {
		t.Errorf("run deadline %v, ctx deadline %v: want within 5s before it", got, want)
	}
}

// Cancelling a Run's ctx cancels the run with cause client_disconnect.
func TestRunCtxCancelIsClientDisconnect(t *testing.T) {
	c := newClient(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	runCtx, stop := context.WithCancel(ctx)
	s, err := c.Run(runCtx, client.Request{Task: slowPlan})
	if err != nil {
		t.Fatal(err)
	}
	// Wait until the tool's node runs, so that the cancel reaches a run that is working.
	for {
		ev, err := s.Next()
		if err != nil {
			t.Fatalf("before the tool started: %v", err)
		}
		if ev.Kind == client.EventNode && ev.Node.GetKind() == meshv1.NodeKind_NODE_KIND_TOOL && ev.Node.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
			break
		}
	}
	stop()
	// Events already received may still come out before the cancel's error.
	for {
		if _, err := s.Next(); err != nil {
			if status.Code(err) != codes.Canceled {
				t.Errorf("the stream ended with %v, want CANCELLED", err)
			}
			break
		}
	}
	run := waitEnded(ctx, t, c, s.RunID())
	if run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || run.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Errorf("run %s ended %v cause %v, want CANCELLED client_disconnect", run.GetRunId(), run.GetStatus(), run.GetCause())
	}
}

// waitEnded polls Get until the run has ended.
func waitEnded(ctx context.Context, t *testing.T, c *client.Client, runID string) *orchestratorv1.Run {
	t.Helper()
	for {
		run, err := c.Get(ctx, runID)
		if err != nil {
			t.Fatalf("Get %s: %v", runID, err)
		}
		if run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return run
		}
		select {
		case <-ctx.Done():
			t.Fatalf("run %s still running", runID)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// One idempotency key starts one run; reusing it for another task is ALREADY_EXISTS.
func TestStartIdempotency(t *testing.T) {
	c := newClient(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	key := fmt.Sprintf("client-test-%d", time.Now().UnixNano())
	req := client.Request{Task: slowPlan, Timeout: time.Minute}
	first, created, err := c.Start(ctx, req, key)
	if err != nil || !created {
		t.Fatalf("first Start: created %v, %v", created, err)
	}
	t.Cleanup(func() { _, _ = c.Cancel(context.Background(), first.GetRunId(), "test over") })
	again, created, err := c.Start(ctx, req, key)
	if err != nil || created || again.GetRunId() != first.GetRunId() {
		t.Fatalf("second Start: run %s created %v, %v; want run %s, not created", again.GetRunId(), created, err, first.GetRunId())
	}
	if got := first.GetDeadline().AsTime().Sub(first.GetCreatedAt().AsTime()); got < 55*time.Second || got > 65*time.Second {
		t.Errorf("run deadline %v after its creation, want Request.Timeout's minute", got)
	}
	other := req
	other.Task = `{"steps": [{"answer_tokens": 5}]}`
	if _, _, err := c.Start(ctx, other, key); status.Code(err) != codes.AlreadyExists {
		t.Errorf("the key with another task: %v, want ALREADY_EXISTS", err)
	}
}

// A wrong or missing key is UNAUTHENTICATED, returned as the server sent it.
func TestAPIKeyRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	wrong, err := client.New(orchestratorAddr, client.WithInsecure(), client.WithAPIKey("cfk_nosuchkey_0000000000000000"))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = wrong.Close() }()
	if _, err := wrong.Run(ctx, client.Request{Task: slowPlan}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("Run with a wrong key: %v, want UNAUTHENTICATED", err)
	}
	none, err := client.New(orchestratorAddr, client.WithInsecure())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = none.Close() }()
	if _, _, err := none.List(ctx, client.ListOptions{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("List without a key: %v, want UNAUTHENTICATED", err)
	}
}

// An API key is not sent in plaintext beyond this machine.
func TestAPIKeyPlaintextOnlyToLoopback(t *testing.T) {
	for target, ok := range map[string]bool{
		"127.0.0.1:7700":                  true,
		"localhost:7700":                  true,
		"[::1]:7700":                      true,
		"dns:///localhost:7700":           true,
		"unix:///run/curfew.sock":         true,
		"orchestrator.example:7700":       false,
		"10.0.0.7:7700":                   false,
		"dns:///orchestrator.example:443": false,
	} {
		c, err := client.New(target, client.WithInsecure(), client.WithAPIKey("cfk_x"))
		if (err == nil) != ok {
			t.Errorf("New(%q, WithInsecure, WithAPIKey): %v; want allowed %v", target, err, ok)
		}
		if c != nil {
			_ = c.Close()
		}
	}
	if _, err := client.New("orchestrator.example:7700", client.WithInsecure(), client.WithTLS(nil)); err == nil {
		t.Error("New with two transports: no error")
	}
}

// List pages through the tenant's runs with a page token, and Runs covers every page.
func TestListPages(t *testing.T) {
	c := newClient(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	for range 3 {
		if _, err := c.RunAndWait(ctx, client.Request{Task: `{"steps": [{"answer_tokens": 1}]}`}); err != nil {
			t.Fatal(err)
		}
	}
	var paged []string
	opts := client.ListOptions{PageSize: 2}
	for {
		runs, next, err := c.List(ctx, opts)
		if err != nil {
			t.Fatal(err)
		}
		if len(runs) > 2 {
			t.Fatalf("page of %d runs, want at most 2", len(runs))
		}
		for _, r := range runs {
			paged = append(paged, r.GetRunId())
		}
		if next == "" {
			break
		}
		opts.PageToken = next
	}
	var all []string
	for r, err := range c.Runs(ctx, 2) {
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, r.GetRunId())
	}
	if len(paged) < 3 || strings.Join(all, ",") != strings.Join(paged, ",") {
		t.Errorf("List pages %v, Runs %v: want the same runs, at least 3", paged, all)
	}
}

// Request.Input reaches the run: the summary carries it, and a Start under the same key
// with another input is ALREADY_EXISTS.
func TestRequestInput(t *testing.T) {
	c := newClient(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	in := &orchestratorv1.RunInput{MaxTokens: 50, MaxSteps: 4, Reserve: "0.1",
		Messages: []*orchestratorv1.Message{{Role: orchestratorv1.MessageRole_MESSAGE_ROLE_SYSTEM, Content: "be brief"}}}
	req := client.Request{Task: `{"steps": [{"answer_tokens": 3}]}`, Input: in}
	run, err := c.RunAndWait(ctx, req)
	if err != nil || run.GetInput().GetMaxTokens() != 50 || run.GetInput().GetMaxSteps() != 4 ||
		run.GetInput().GetMessages()[0].GetContent() != "be brief" || run.GetInput().GetReserve() != "0.1" {
		t.Fatalf("RunAndWait = %v, %v; want the run with its input", run.GetInput(), err)
	}
	bad := req
	bad.Input = &orchestratorv1.RunInput{MaxSteps: -1}
	if _, err := c.RunAndWait(ctx, bad); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "max_steps") {
		t.Errorf("max_steps -1: %v, want INVALID_ARGUMENT naming max_steps", err)
	}
	key := fmt.Sprintf("client-input-%d", time.Now().UnixNano())
	req.Timeout = time.Minute
	if _, created, err := c.Start(ctx, req, key); err != nil || !created {
		t.Fatalf("Start: created %v, %v", created, err)
	}
	other := req
	other.Input = &orchestratorv1.RunInput{MaxTokens: 51, MaxSteps: 4, Messages: in.GetMessages()}
	if _, _, err := c.Start(ctx, other, key); status.Code(err) != codes.AlreadyExists {
		t.Errorf("the key with another input: %v, want ALREADY_EXISTS", err)
	}
}

// Request.Events is what Run streams: node updates only with RUN_EVENTS_NODES, where the
// default also streams the text of each model step. Start, which streams nothing,
// refuses it.
func TestRequestEvents(t *testing.T) {
	c := newClient(t)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	count := func(events orchestratorv1.RunEvents) map[client.EventKind]int {
		t.Helper()
		s, err := c.Run(ctx, client.Request{Task: `{"steps": [{"answer_tokens": 5}]}`, Events: events})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		kinds := map[client.EventKind]int{}
		for {
			ev, err := s.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			kinds[ev.Kind]++
		}
		if n := len(s.Summary().GetNodes()); n != 2 {
			t.Errorf("events %v: summary of %d nodes, want the run and its model step", events, n)
		}
		return kinds
	}
	if all := count(orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED); all[client.EventNodeEvent] == 0 || all[client.EventNode] == 0 {
		t.Errorf("default: %v, want node updates and text", all)
	}
	if nodes := count(orchestratorv1.RunEvents_RUN_EVENTS_NODES); nodes[client.EventNodeEvent] != 0 || nodes[client.EventNode] == 0 {
		t.Errorf("RUN_EVENTS_NODES: %v, want node updates only", nodes)
	}
	if summary := count(orchestratorv1.RunEvents_RUN_EVENTS_SUMMARY); len(summary) != 2 || summary[client.EventStarted] != 1 || summary[client.EventFinished] != 1 {
		t.Errorf("RUN_EVENTS_SUMMARY: %v, want Started and Finished only", summary)
	}
	if _, _, err := c.Start(ctx, client.Request{Task: `{"steps": [{"answer_tokens": 1}]}`, Events: orchestratorv1.RunEvents_RUN_EVENTS_NODES}, ""); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Start with Events: %v, want INVALID_ARGUMENT", err)
	}
}
