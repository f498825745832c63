package retry

import (
	"context"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/md"
)

// NewID mints a retry-id (curfew-retry-id): a UUIDv7, once per logical call. Its error is
// an INTERNAL status.
func NewID() (string, error) {
	u, err := uuid.NewV7()
	if err != nil {
		return "", status.Error(codes.Internal, "internal error")
	}
	return u.String(), nil
}

// WithID returns ctx and the retry-id on its outgoing metadata, minting one (NewID) and
// adding it when there is none. A caller that needs the id before the call starts (to key
// a lease by it) takes it here; the retry interceptor then keeps the id it finds.
func WithID(ctx context.Context) (context.Context, string, error) {
	if id := outgoingID(ctx); id != "" {
		return ctx, id, nil
	}
	id, err := NewID()
	if err != nil {
		return nil, "", err
	}
	return metadata.AppendToOutgoingContext(ctx, md.RetryID, id), id, nil
}

// outgoingID returns the retry-id on ctx's outgoing metadata, "" when there is none.
func outgoingID(ctx context.Context) string {
	if v := metadata.ValueFromOutgoingContext(ctx, md.RetryID); len(v) > 0 {
		return v[0]
	}
	return ""
}
