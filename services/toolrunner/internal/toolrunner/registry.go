package toolrunner

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/toollist"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
)

// prepareRegistry checks a call of a registry tool (package registry: NOT_FOUND,
// UNAVAILABLE, INVALID_ARGUMENT before anything is sent) and returns the function that
// runs it as the tool's node. The tool's progress reaches the caller as node events of
// the node, none after the call returned. A tool's failure in its own terms (MCP
// isError, ToolService is_error) fails the node FAILED_PRECONDITION with the tool's
// text: the tool ran and refused, so no layer retries it and no breaker counts it, as
// with a built-in's refusal.
func (s *Server) prepareRegistry(ctx context.Context, name string, raw []byte, event func(*meshv1.NodeEvent)) (execFunc, gate, error) {
	p, err := s.cfg.Tools.Prepare(md.IdentityFrom(ctx).Tenant, name, raw)
	if err != nil {
		return nil, gate{}, err
	}
	g := gate{why: p.Approval(), minTime: p.MinTime()}
	return func(ctx context.Context) (string, *meshv1.Cleanup, error) {
		id := md.IdentityFrom(ctx)
		meta := source.Meta{RunID: id.RunID, NodeID: id.NodeID, RetryID: id.RetryID, Attempt: max(id.Attempt, 1),
			IdempotencyKey: md.IdempotencyKeyFrom(ctx), Hedge: md.HedgeFrom(ctx)}
		if dl, ok := ctx.Deadline(); ok {
			meta.Deadline = dl
		}
		// (event drops what comes after the node ended; the source drops what comes after
		// Call returned.)
		res, err := p.Run(ctx, meta, func(pr *meshv1.Progress) {
			event(&meshv1.NodeEvent{Kind: &meshv1.NodeEvent_Progress{Progress: pr}})
		})
		switch {
		case err != nil:
			return "", nil, err
		case res.IsError:
			return "", nil, status.Errorf(codes.FailedPrecondition, "tool %s failed: %s", name, res.Text)
		case len(res.Output) == 0:
			return "null", nil, nil
		}
		return string(res.Output), nil, nil
	}, g, nil
}

// ListTools implements ToolRunnerService: the tools the calling tenant may call, the
// built-ins models are told of first. Without a registry, the built-ins only.
func (s *Server) ListTools(ctx context.Context, _ *toolrunnerv1.ListToolsRequest) (*toolrunnerv1.ListToolsResponse, error) {
	resp := &toolrunnerv1.ListToolsResponse{}
	if s.cfg.Tools == nil {
		for _, b := range catalog.Builtins() {
			if b.Spec != nil {
				resp.Tools = append(resp.Tools, &toolrunnerv1.ToolInfo{Name: b.Name, Description: b.Spec.GetDescription(),
					InputSchemaJson: b.Spec.GetParametersJson(), SideEffects: toollist.Proto(b.SideEffects)})
			}
		}
		return resp, nil
	}
	for _, t := range s.cfg.Tools.Tools(md.IdentityFrom(ctx).Tenant) {
		resp.Tools = append(resp.Tools, &toolrunnerv1.ToolInfo{Name: t.Name, Description: t.Description,
			InputSchemaJson: string(t.InputSchema), SideEffects: toollist.Proto(t.SideEffects)})
	}
	return resp, nil
}
