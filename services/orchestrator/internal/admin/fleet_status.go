package admin

import (
	"context"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
)

// fleetStatus adds every modelproxy replica's decoders and breakers to out.
func (s *Server) fleetStatus(ctx context.Context, out *adminv1.StatusResponse) {
	_, _ = ctx, out // filled in when the decoders' fan-out lands (r22/decoders)
}
