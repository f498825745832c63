package meshtls

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
)

// AnyPeer in Rule.Callers allows every caller with a mesh identity.
const AnyPeer = "*"

// Rule allows callers to call methods.
type Rule struct {
	// Method is a full method name ("/curfew.toolrunner.v1.ToolRunnerService/Execute")
	// or, when it ends in '/' or '.', a prefix of the full method names it covers
	// ("/curfew.toolrunner.v1.ToolRunnerService/" for a whole service).
	Method string
	// Callers are the mesh identities allowed, or AnyPeer.
	Callers []string
	// Public allows every caller, one without a mesh identity too (on a server with
	// VerifyClientCertIfGiven).
	Public bool
}

// Policy authorizes calls by the caller's mesh identity (PeerIdentity) and the method.
// Its rules only allow: a call is allowed when a rule covering its method allows its
// caller, and refused otherwise, with UNAUTHENTICATED when the caller has no mesh
// identity and PERMISSION_DENIED when it has one.
type Policy struct {
	rules []Rule
}

// NewPolicy returns the Policy of rules. A rule's Method must begin with '/', and it
// must be Public or name at least one caller, each AnyPeer or a valid identity.
func NewPolicy(rules ...Rule) (*Policy, error) {
	for _, r := range rules {
		if !strings.HasPrefix(r.Method, "/") {
			return nil, fmt.Errorf("meshtls: rule method %q does not begin with '/'", r.Method)
		}
		if !r.Public && len(r.Callers) == 0 {
			return nil, fmt.Errorf("meshtls: rule %s allows no caller", r.Method)
		}
		for _, c := range r.Callers {
			if c != AnyPeer && !validIdentity(c) {
				return nil, fmt.Errorf("meshtls: rule %s: caller %q is not an identity", r.Method, c)
			}
		}
	}
	return &Policy{rules: slices.Clone(rules)}, nil
}

// Rules returns the policy's rules.
func (p *Policy) Rules() []Rule { return slices.Clone(p.rules) }

// Authorize returns nil if the caller of ctx (a server call's context) may call
// fullMethod, else a status error: UNAUTHENTICATED when it has no mesh identity,
// PERMISSION_DENIED ("<identity> may not call <method>") when it has one.
func (p *Policy) Authorize(ctx context.Context, fullMethod string) error {
	id, ok := PeerIdentity(ctx)
	for i := range p.rules {
		r := &p.rules[i]
		if !r.covers(fullMethod) {
			continue
		}
		if r.Public || ok && (slices.Contains(r.Callers, id) || slices.Contains(r.Callers, AnyPeer)) {
			return nil
		}
	}
	if !ok {
		return status.Errorf(codes.Unauthenticated, "%s needs a curfew mesh client certificate", fullMethod)
	}
	return status.Errorf(codes.PermissionDenied, "%s may not call %s", id, fullMethod)
}

func (r *Rule) covers(fullMethod string) bool {
	if strings.HasSuffix(r.Method, "/") || strings.HasSuffix(r.Method, ".") {
		return strings.HasPrefix(fullMethod, r.Method)
	}
	return fullMethod == r.Method
}

// UnaryServerInterceptor returns a server interceptor that refuses the unary calls
// Authorize refuses, before their handler runs.
func (p *Policy) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if err := p.Authorize(ctx, info.FullMethod); err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// StreamServerInterceptor returns a server interceptor that refuses the streams
// Authorize refuses, before their handler runs.
func (p *Policy) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if err := p.Authorize(ss.Context(), info.FullMethod); err != nil {
			return err
		}
		return handler(srv, ss)
	}
}

// The gRPC services of the call graph, as method prefixes.
var (
	orchestratorAPI = "/" + orchestratorv1.OrchestratorService_ServiceDesc.ServiceName + "/"
	deadLetterAPI   = "/" + orchestratorv1.DeadLetterService_ServiceDesc.ServiceName + "/"
	adminAPI        = "/" + adminv1.AdminService_ServiceDesc.ServiceName + "/"
	toolRunnerAPI   = "/" + toolrunnerv1.ToolRunnerService_ServiceDesc.ServiceName + "/"
	subagentAPI     = "/" + subagentv1.SubagentService_ServiceDesc.ServiceName + "/"
	nodeReportAPI   = "/" + meshv1.NodeReportService_ServiceDesc.ServiceName + "/"
	listNodes       = meshv1.NodeReportService_ListNodes_FullMethodName
	healthAPI       = "/" + healthpb.Health_ServiceDesc.ServiceName + "/"
	reflectionAPI   = "/grpc.reflection." // v1 and v1alpha
)

// callGraph is curfew's call graph as each server enforces it: who may call which of its
// gRPC services (../shared/DESIGN.md, "The four services"). The mesh edges are the
// services' Runtime.Dial calls in services/*/cmd/*/main.go and the clients made on those
// connections; keep them in step. The package doc shows the same table.
var callGraph = map[string][]Rule{
	Orchestrator: {
		// The public API: external callers need no mesh certificate (their API keys
		// authenticate them: apikey.Guard in the server chain); the CLI and mesh peers
		// may call it too.
		{Method: orchestratorAPI, Public: true},
		{Method: deadLetterAPI, Public: true},
		// The operators' API: open here, because an operator's API key (admin or
		// read-only scope) needs no mesh certificate; the orchestrator's admin
		// authorizer then admits only curfew-cli and keys with an operator scope.
		{Method: adminAPI, Public: true},
	},
	ToolRunner: {
		{Method: toolRunnerAPI, Callers: []string{Orchestrator, Subagent}},
		{Method: nodeReportAPI, Callers: []string{Orchestrator, Subagent}},
		{Method: listNodes, Callers: []string{CLI}}, // operators and e2e tests read node tables
	},
	Subagent: {
		{Method: subagentAPI, Callers: []string{ToolRunner}}, // spawn_subagent
		{Method: nodeReportAPI, Callers: []string{Orchestrator, ToolRunner}},
		{Method: listNodes, Callers: []string{CLI}},
	},
	ModelProxy: {
		// The model calls, by method rather than the whole service: the operators'
		// methods (ListDecoders, CancelDecoders) are the orchestrator's alone, which
		// fans them out for the admin API.
		{Method: modelproxyv1.ModelProxyService_Generate_FullMethodName, Callers: []string{Orchestrator, Subagent}},
		{Method: modelproxyv1.ModelProxyService_RenewLeases_FullMethodName, Callers: []string{Orchestrator, Subagent}},
		{Method: modelproxyv1.ModelProxyService_ListModels_FullMethodName, Callers: []string{Orchestrator, Subagent}},
		{Method: modelproxyv1.ModelProxyService_ListDecoders_FullMethodName, Callers: []string{Orchestrator}},
		{Method: modelproxyv1.ModelProxyService_CancelDecoders_FullMethodName, Callers: []string{Orchestrator}},
		{Method: nodeReportAPI, Callers: []string{Orchestrator, Subagent}},
		{Method: listNodes, Callers: []string{CLI}},
	},
}

// everyServer are the rules of every server: health and reflection for every mesh peer
// (grpcurl, grpc-health-probe and `curfew up` with a mesh certificate).
var everyServer = []Rule{
	{Method: healthAPI, Callers: []string{AnyPeer}},
	{Method: reflectionAPI, Callers: []string{AnyPeer}},
}

// DefaultPolicy returns the Policy of the server of curfew's service server
// (Orchestrator, ToolRunner, Subagent or ModelProxy): its edges of curfew's call graph
// (see the package doc), plus health and reflection for every mesh peer.
func DefaultPolicy(server string) (*Policy, error) {
	rules, ok := callGraph[server]
	if !ok {
		return nil, fmt.Errorf("meshtls: no default policy for service %q", server)
	}
	return NewPolicy(append(slices.Clone(rules), everyServer...)...)
}
