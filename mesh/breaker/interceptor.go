package breaker

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// UnaryClientInterceptor guards unary calls to target with the set's breaker for it
// (resolved once, here). A refused call is not sent; its error is Allow's, marked with
// the retry package's RETRIES_EXHAUSTED ErrorInfo (attempts "0") so that no retry layer,
// this connection's or a caller's further up, retries it: see the package doc.
func (s *Set) UnaryClientInterceptor(target string) grpc.UnaryClientInterceptor {
	if s.cfg.Off {
		return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
	}
	b := s.Get(target)
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) (err error) {
		cctx, ci := withCall(ctx, method)
		done, err := b.allow(cctx, true)
		if err != nil {
			return err
		}
		returned := false
		defer func() {
			if !returned { // the invoker panicked: a failure, and the probe slot is freed
				done(status.Error(codes.Internal, "panic in the call"))
			}
		}()
		// A fresh slice: appending to opts could write into the caller's backing array.
		p := new(peer.Peer)
		all := append(append(make([]grpc.CallOption, 0, len(opts)+1), opts...), grpc.Peer(p))
		err = invoker(ctx, method, req, reply, cc, all...)
		returned = true
		ci.setPeer(p.Addr)
		done(err)
		return err
	}
}

// StreamClientInterceptor guards streaming calls to target. A stream's outcome is its end
// status, reported by gRPC once when the stream finishes (grpc.OnFinish), except for a
// half-open probe, which succeeds at its first message (probeStream): io.EOF after
// the last message is a success, an error status is judged by Classify, and a stream the
// caller abandons by cancelling its context ends CANCELED with the caller's context done,
// which is ignored. No goroutine is started and, but for a probe, the stream is not
// wrapped. As with any gRPC stream, the caller must read it to the end or cancel its
// context; a stream left open holds its outcome (and, half-open, the probe slot) until
// then.
func (s *Set) StreamClientInterceptor(target string) grpc.StreamClientInterceptor {
	if s.cfg.Off {
		return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return streamer(ctx, desc, cc, method, opts...)
		}
	}
	b := s.Get(target)
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (_ grpc.ClientStream, err error) {
		cctx, ci := withCall(ctx, method)
		done, err := b.allow(cctx, true)
		if err != nil {
			return nil, err
		}
		returned := false
		defer func() {
			if !returned {
				done(status.Error(codes.Internal, "panic in the call"))
			}
		}()
		// A fresh slice: appending to opts could write into the caller's backing array.
		all := make([]grpc.CallOption, 0, len(opts)+1)
		all = append(append(all, opts...), grpc.OnFinish(done))
		cs, err := streamer(ctx, desc, cc, method, all...)
		returned = true
		if err != nil {
			done(err) // gRPC has reported it already when it made an attempt; done is idempotent
			return nil, err
		}
		if p, ok := peer.FromContext(cs.Context()); ok && p.Addr != nil { //nolint:contextcheck // reads the stream's peer, makes no call
			ci.setPeer(p.Addr)
			b.up(p.Addr.String()) // a stream opened on it: the endpoint is up
		}
		if b.State() == StateHalfOpen {
			return &probeStream{ClientStream: cs, done: done}, nil
		}
		return cs, nil
	}
}

// probeStream is a half-open breaker's probe on a stream. A stream may last as long as
// its caller's deadline (a subagent's run, a long decode), and while the probe is out the
// breaker refuses every other call, on this replica and, coordinated, on the others. So a
// probe stream's first message from the target is its success: the target is up and
// serving. Its end status is then not judged (done takes the first outcome). A stream
// that ends before its first message is judged by its end status, as any stream.
//
// Only a probe is wrapped: a closed breaker's streams keep their end status as their
// outcome, with nothing added to their path. A stream wrapped because the breaker
// half-opened just after its call was allowed is judged early too, which is harmless.
type probeStream struct {
	grpc.ClientStream
	done func(error)
}

func (s *probeStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if err == nil {
		s.done(nil)
	}
	return err
}
