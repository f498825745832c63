package mesh

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Status maps err to a gRPC status error for the wire. Status errors pass unchanged;
// context cancellation and deadline map to CANCELED and DEADLINE_EXCEEDED; anything else
// becomes INTERNAL with a generic message, and internal reports whether that happened so
// the caller can log the original.
func Status(err error) (out error, internal bool) {
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
	e, _ := Status(err)
	return status.Code(e)
}
