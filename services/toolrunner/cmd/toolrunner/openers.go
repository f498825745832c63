package main

import (
	"context"

	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source/grpctool"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source/mcp"
)

// openers returns how each kind of tool source is opened. A kind without an opener
// stops toolrunner at start when --tools-config names a source of it.
func openers() map[string]registry.Opener {
	return map[string]registry.Opener{
		registry.KindMCPStdio: func(ctx context.Context, sc registry.SourceConfig, h registry.Hooks) (source.Source, error) {
			return mcp.OpenStdio(ctx, mcp.StdioConfig{Name: sc.Name, Command: sc.Command, Args: sc.Args, Env: sc.Environ(), Dir: sc.Dir},
				mcp.Options{Late: h.Late, Logger: h.Logger})
		},
		// Plaintext, with none of the mesh's client chain: the registry retries and breaks
		// the source's calls itself, and a team's tool server holds no mesh certificate.
		registry.KindGRPC: func(ctx context.Context, sc registry.SourceConfig, h registry.Hooks) (source.Source, error) {
			return grpctool.Open(ctx, grpctool.Config{Name: sc.Name, Address: sc.Address}, grpctool.Options{Late: h.Late, Logger: h.Logger})
		},
		registry.KindMCPHTTP: func(ctx context.Context, sc registry.SourceConfig, h registry.Hooks) (source.Source, error) {
			return mcp.OpenHTTP(ctx, mcp.HTTPConfig{Name: sc.Name, URL: sc.URL, Header: sc.Header()}, mcp.Options{Late: h.Late, Logger: h.Logger})
		},
	}
}
