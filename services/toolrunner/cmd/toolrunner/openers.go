package main

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/registry"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source/grpctool"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source/mcp"
)

// clientChain returns the mesh's client chain for a connection with the retries rc
// says: toolrunner's is the runtime's (service.Runtime.ClientOptions: its client
// metrics and tracing).
type clientChain func(rc retry.Config) []grpc.DialOption

// bareChain is the mesh's client chain without metrics or tracing.
func bareChain(rc retry.Config) []grpc.DialOption {
	return mesh.DialOptions(mesh.ClientConfig{Retry: rc})
}

// openers returns how each kind of tool source is opened, grpc sources dialled with
// chain (bareChain when nil). A kind without an opener stops toolrunner at start when
// --tools-config names a source of it.
func openers(chain clientChain) map[string]registry.Opener {
	if chain == nil {
		chain = bareChain
	}
	return map[string]registry.Opener{
		registry.KindMCPStdio: func(ctx context.Context, sc registry.SourceConfig, h registry.Hooks) (source.Source, error) {
			return mcp.OpenStdio(ctx, mcp.StdioConfig{Name: sc.Name, Command: sc.Command, Args: sc.Args, Env: sc.Environ(), Dir: sc.Dir},
				mcp.Options{Late: h.Late, Logger: h.Logger})
		},
		registry.KindGRPC: func(ctx context.Context, sc registry.SourceConfig, h registry.Hooks) (source.Source, error) {
			// The mesh's client chain (the client metrics, tracing, and curfew's metadata
			// stamped on every call) with its retries off: the registry already retries
			// each call as the tool's retry policy and side effects allow, under the run's
			// deadline, and lists a down source again with backoff, all through the
			// source's own breaker. A second retrying layer here would multiply the
			// attempts (3 × 3 with the defaults) and repeat calls the registry chose not
			// to; marking only irreversible calls (retry.SideEffect) would still double
			// the others'. The chain's breaker is left out for the same reason: the
			// registry's, one per source, is the source's breaker.
			opts := chain(retry.Config{Target: "tool:" + sc.Name, Default: retry.Policy{Disabled: true}})
			// Plaintext (h2c, in the cluster) unless the source configures tls: a team's
			// tool server holds no mesh certificate, so the mesh's mTLS is not used.
			if sc.TLS != nil {
				tc, err := sc.TLS.ClientConfig()
				if err != nil {
					return nil, status.Errorf(codes.InvalidArgument, "grpc tool source %q: %v", sc.Name, err)
				}
				opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
			}
			return grpctool.Open(ctx, grpctool.Config{Name: sc.Name, Address: sc.Address, DialOptions: opts},
				grpctool.Options{Late: h.Late, Logger: h.Logger})
		},
		registry.KindMCPHTTP: func(ctx context.Context, sc registry.SourceConfig, h registry.Hooks) (source.Source, error) {
			return mcp.OpenHTTP(ctx, mcp.HTTPConfig{Name: sc.Name, URL: sc.URL, Header: sc.Header()}, mcp.Options{Late: h.Late, Logger: h.Logger})
		},
	}
}
