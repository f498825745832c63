package mesh

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Status maps err to a gRPC status error for the wire. Status errors pass unchanged;
// context cancellation and deadline map to CANCELED and DEADLINE_EXCEEDED; anything else
// becomes INTERNAL with a generic message (the server chain logs the original).
func Status(err error) error {
	out, _ := toStatus(err)
	return out
}

// toStatus is Status, also reporting whether err was an internal error.
func toStatus(err error) (out error, internal bool) { //nolint:revive // internal is a flag beside the result
	if err == nil {
		return nil, false
	}
	if _, ok := status.FromError(err); ok {
		return err, false
	}
	switch {
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, "cancelled"), false
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, "deadline exceeded"), false
	}
	return status.Error(codes.Internal, "internal error"), true
}

// Code returns the gRPC code of err as Status would map it.
func Code(err error) codes.Code {
	return status.Code(Status(err))
}
