package mesh

import (
	"context"

	"google.golang.org/grpc"
)

// ServerOptionsRecording is ServerOptions with every interceptor layer wrapped to call
// record with the layer's name as a call enters it: the chain compiled as ServerOptions
// compiles it, so the names come in the order a call runs the layers.
func ServerOptionsRecording(cfg ServerConfig, record func(layer string)) []grpc.ServerOption {
	stages := serverStages(cfg)
	for i, s := range stages {
		if d := s.derive; d != nil {
			name := s.name
			stages[i].derive = func(ctx context.Context, method string) (context.Context, func(), error) {
				record(name)
				return d(ctx, method)
			}
			continue
		}
		if s.unary == nil {
			continue
		}
		name, u, st := s.name, s.unary, s.stream
		stages[i].unary = func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			record(name)
			return u(ctx, req, info, h)
		}
		stages[i].stream = func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			record(name)
			return st(srv, ss, info, h)
		}
	}
	return compile(stages)
}

// ServerChainNames are the names of serverChain's layers, outermost first.
func ServerChainNames() []string {
	var out []string
	for _, l := range serverChain {
		out = append(out, l.name)
	}
	return out
}

// ClientChainNames are the names of clientChain's layers, outermost first.
func ClientChainNames() []string {
	var out []string
	for _, l := range clientChain {
		out = append(out, l.name)
	}
	return out
}

// ChainReasons are the why of every layer of both chains.
func ChainReasons() map[string]string {
	out := map[string]string{}
	for _, l := range serverChain {
		out["server/"+l.name] = l.why
	}
	for _, l := range clientChain {
		out["client/"+l.name] = l.why
	}
	return out
}
