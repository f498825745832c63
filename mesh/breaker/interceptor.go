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
		p := new(peer.Peer)
		done, err := b.allow(withCall(ctx, method, p), true)
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
		all := append(append(make([]grpc.CallOption, 0, len(opts)+1), opts...), grpc.Peer(p))
		err = invoker(ctx, method, req, reply, cc, all...)
		returned = true
		done(err)
		return err
	}
}

// StreamClientInterceptor guards streaming calls to target. A stream's outcome is its end
// status, reported by gRPC once when the stream finishes (grpc.OnFinish): io.EOF after
// the last message is a success, an error status is judged by Classify, and a stream the
// caller abandons by cancelling its context ends CANCELED with the caller's context done,
// which is ignored. No goroutine is started and the stream is not wrapped. As with any
// gRPC stream, the caller must read it to the end or cancel its context; a stream left
// open holds its outcome (and, half-open, the probe slot) until then.
func (s *Set) StreamClientInterceptor(target string) grpc.StreamClientInterceptor {
	if s.cfg.Off {
		return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return streamer(ctx, desc, cc, method, opts...)
		}
	}
	b := s.Get(target)
	return func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (_ grpc.ClientStream, err error) {
		p := new(peer.Peer)
		done, err := b.allow(withCall(ctx, method, p), true)
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
		// gRPC fills in the peer before it calls OnFinish.
		all := make([]grpc.CallOption, 0, len(opts)+2)
		all = append(append(all, opts...), grpc.Peer(p), grpc.OnFinish(done))
		cs, err := streamer(ctx, desc, cc, method, all...)
		returned = true
		if err != nil {
			done(err) // gRPC has reported it already when it made an attempt; done is idempotent
			return nil, err
		}
		return cs, nil
	}
}
