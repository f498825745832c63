package retryid_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/retryid"
)

func TestUnaryServerInterceptor(t *testing.T) {
	tb := retryid.New(long, nil)
	icpt := tb.UnaryServerInterceptor()
	info := &grpc.UnaryServerInfo{FullMethod: method}

	handlerCtx := make(chan context.Context, 1)
	first := make(chan error, 1)
	var returned atomic.Bool
	go func() {
		_, err := icpt(attemptCtx("acme", "u", 1), "req", info, func(ctx context.Context, _ any) (any, error) {
			handlerCtx <- ctx
			<-ctx.Done()
			time.Sleep(20 * time.Millisecond) // teardown
			returned.Store(true)
			return nil, ctx.Err()
		})
		first <- err
	}()
	var h1 context.Context
	select {
	case h1 = <-handlerCtx:
	case <-time.After(long):
		t.Fatal("attempt 1's handler did not start")
	}

	resp, err := icpt(attemptCtx("acme", "u", 2), "req", info, func(ctx context.Context, req any) (any, error) {
		if !returned.Load() {
			t.Error("attempt 2's handler runs before attempt 1's returned")
		}
		// A late duplicate arriving while attempt 2 runs never reaches the handler.
		called := false
		_, err := icpt(attemptCtx("acme", "u", 1), "req", info, func(context.Context, any) (any, error) {
			called = true
			return nil, nil
		})
		if status.Code(err) != codes.Aborted || called {
			t.Errorf("late duplicate: %v (handler called: %v), want ABORTED without the handler", err, called)
		}
		return "resp-" + req.(string), nil
	})
	if err != nil || resp != "resp-req" {
		t.Fatalf("attempt 2: %v, %v", resp, err)
	}
	if !errors.Is(context.Cause(h1), cancel.ErrSuperseded) {
		t.Fatalf("attempt 1's cause = %v", context.Cause(h1))
	}
	select {
	case err := <-first:
		// The superseded attempt tells its client why.
		if status.Code(err) != codes.Canceled || !strings.Contains(err.Error(), "superseded") {
			t.Fatalf("attempt 1 returned %v, want CANCELED: superseded", err)
		}
	case <-time.After(long):
		t.Fatal("attempt 1 did not return")
	}

	// Other errors pass unchanged.
	want := status.Error(codes.NotFound, "no run")
	if _, err := icpt(attemptCtx("acme", "u2", 1), "req", info, func(context.Context, any) (any, error) { return nil, want }); !errors.Is(err, want) {
		t.Fatalf("handler error became %v", err)
	}
}

// fakeServerStream is a server stream that only has a context.
type fakeServerStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (f *fakeServerStream) Context() context.Context { return f.ctx }

func wrapStream(ctx context.Context, ss grpc.ServerStream) grpc.ServerStream {
	return &fakeServerStream{ServerStream: ss, ctx: ctx}
}

func TestStreamServerInterceptor(t *testing.T) {
	tb := retryid.New(long, nil)
	icpt := tb.StreamServerInterceptor(wrapStream)
	info := &grpc.StreamServerInfo{FullMethod: method, IsServerStream: true}

	handlerCtx := make(chan context.Context, 1)
	first := make(chan error, 1)
	go func() {
		first <- icpt(nil, &fakeServerStream{ctx: attemptCtx("acme", "s", 1)}, info, func(_ any, ss grpc.ServerStream) error {
			handlerCtx <- ss.Context()
			<-ss.Context().Done()
			return ss.Context().Err()
		})
	}()
	var h1 context.Context
	select {
	case h1 = <-handlerCtx:
	case <-time.After(long):
		t.Fatal("attempt 1's handler did not start")
	}
	err := icpt(nil, &fakeServerStream{ctx: attemptCtx("acme", "s", 2)}, info, func(_ any, ss grpc.ServerStream) error {
		if ss.Context().Err() != nil {
			t.Error("attempt 2's handler got a done context")
		}
		return nil
	})
	if err != nil {
		t.Fatalf("attempt 2: %v", err)
	}
	if !errors.Is(context.Cause(h1), cancel.ErrSuperseded) {
		t.Fatalf("attempt 1's handler context cause = %v", context.Cause(h1))
	}
	select {
	case err := <-first:
		if status.Code(err) != codes.Canceled || !strings.Contains(err.Error(), "superseded") {
			t.Fatalf("attempt 1 returned %v, want CANCELED: superseded", err)
		}
	case <-time.After(long):
		t.Fatal("attempt 1 did not return")
	}
}
