package mesh

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
)

type ctxKey string

// fakeStream is the least of a grpc.ServerStream: its context.
type fakeStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (f fakeStream) Context() context.Context { return f.ctx }

// recordingSteps returns three derive steps that log what they do into log: a, which
// adds a value; b, which adds one and a cleanup; c, which refuses the call when refuse.
func recordingSteps(log *[]string, refuse bool) []derive {
	return []derive{
		func(ctx context.Context, _ string) (context.Context, func(), error) {
			*log = append(*log, "a")
			return context.WithValue(ctx, ctxKey("a"), 1), func() { *log = append(*log, "cleanup a") }, nil
		},
		func(ctx context.Context, _ string) (context.Context, func(), error) {
			*log = append(*log, "b")
			if ctx.Value(ctxKey("a")) == nil {
				*log = append(*log, "b did not see a's context")
			}
			return context.WithValue(ctx, ctxKey("b"), 1), func() { *log = append(*log, "cleanup b") }, nil
		},
		func(ctx context.Context, _ string) (context.Context, func(), error) {
			*log = append(*log, "c")
			if refuse {
				return nil, nil, errors.New("refused")
			}
			return ctx, nil, nil
		},
	}
}

func TestDerivedRunsStepsInOrderAndCleansUpInReverse(t *testing.T) {
	for _, kind := range []string{"unary", "stream"} {
		t.Run(kind, func(t *testing.T) {
			var log []string
			unary, stream := derived(recordingSteps(&log, false))
			check := func(ctx context.Context) {
				log = append(log, "handler")
				if ctx.Value(ctxKey("a")) == nil || ctx.Value(ctxKey("b")) == nil {
					t.Error("the handler's context lacks the steps' values")
				}
			}
			var err error
			if kind == "unary" {
				_, err = unary(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: "/s/M"},
					func(ctx context.Context, _ any) (any, error) { check(ctx); return nil, nil })
			} else {
				err = stream(nil, fakeStream{ctx: context.Background()}, &grpc.StreamServerInfo{FullMethod: "/s/M"},
					func(_ any, ss grpc.ServerStream) error { check(ss.Context()); return nil })
			}
			if err != nil {
				t.Fatal(err)
			}
			want := []string{"a", "b", "c", "handler", "cleanup b", "cleanup a"}
			if !slices.Equal(log, want) {
				t.Errorf("got %q, want %q", log, want)
			}
		})
	}
}

func TestDerivedRefusalSkipsTheRestAndCleansUp(t *testing.T) {
	var log []string
	steps := append(recordingSteps(&log, true), func(ctx context.Context, _ string) (context.Context, func(), error) {
		log = append(log, "d")
		return ctx, nil, nil
	})
	_, stream := derived(steps)
	err := stream(nil, fakeStream{ctx: context.Background()}, &grpc.StreamServerInfo{FullMethod: "/s/M"},
		func(any, grpc.ServerStream) error { log = append(log, "handler"); return nil })
	if err == nil || err.Error() != "refused" {
		t.Fatalf("got %v, want the step's refusal", err)
	}
	want := []string{"a", "b", "c", "cleanup b", "cleanup a"}
	if !slices.Equal(log, want) {
		t.Errorf("got %q, want %q", log, want)
	}
}

func TestDerivedKeepsTheStreamWhenNoStepChangesTheContext(t *testing.T) {
	same := func(ctx context.Context, _ string) (context.Context, func(), error) { return ctx, nil, nil }
	_, stream := derived([]derive{same, same})
	in := fakeStream{ctx: context.Background()}
	err := stream(nil, in, &grpc.StreamServerInfo{FullMethod: "/s/M"}, func(_ any, ss grpc.ServerStream) error {
		if _, ok := ss.(fakeStream); !ok {
			t.Errorf("the handler got a %T, want the stream itself", ss)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// Adjacent derive layers compile to one interceptor: a layer chained by grpc-go costs two
// frames on every handler's stack for the call's whole life.
func TestAdjacentDeriveLayersAreOneInterceptor(t *testing.T) {
	cfg := ServerConfig{
		Authorize: func(context.Context, string) error { return nil },
		MinTime:   map[string]time.Duration{"/s/M": 1},
	}
	var derives, others int
	for _, s := range serverStages(cfg) {
		switch {
		case s.derive != nil:
			derives++
		case s.unary != nil:
			others++
		}
	}
	if derives < 2 {
		t.Fatalf("%d derive layers: the test needs a run of them", derives)
	}
	_, us, ss := interceptors(serverStages(cfg))
	if len(us) != others+1 || len(ss) != others+1 {
		t.Errorf("%d unary and %d stream interceptors, want %d: the %d other layers and one for the derive layers",
			len(us), len(ss), others+1, others)
	}
}
