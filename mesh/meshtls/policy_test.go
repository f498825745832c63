package meshtls_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net/url"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

func insecureCreds() credentials.TransportCredentials { return insecure.NewCredentials() }

// peerContext returns a server call's context whose caller presented a verified
// certificate with uris as URI SANs; none: a TLS caller without a certificate.
func peerContext(t *testing.T, uris ...string) context.Context {
	t.Helper()
	var state tls.ConnectionState
	if len(uris) > 0 {
		cert := &x509.Certificate{}
		for _, u := range uris {
			pu, err := url.Parse(u)
			if err != nil {
				t.Fatal(err)
			}
			cert.URIs = append(cert.URIs, pu)
		}
		state.PeerCertificates = []*x509.Certificate{cert}
		state.VerifiedChains = [][]*x509.Certificate{{cert}}
	}
	return peer.NewContext(t.Context(), &peer.Peer{AuthInfo: credentials.TLSInfo{State: state}})
}

// served are the gRPC services each server registers (services/*/cmd/*/main.go).
var served = map[string][]grpc.ServiceDesc{
	meshtls.Orchestrator: {orchestratorv1.OrchestratorService_ServiceDesc, orchestratorv1.DeadLetterService_ServiceDesc},
	meshtls.ToolRunner:   {toolrunnerv1.ToolRunnerService_ServiceDesc, meshv1.NodeReportService_ServiceDesc},
	meshtls.Subagent:     {subagentv1.SubagentService_ServiceDesc, meshv1.NodeReportService_ServiceDesc},
	meshtls.ModelProxy:   {modelproxyv1.ModelProxyService_ServiceDesc, meshv1.NodeReportService_ServiceDesc},
}

// everywhere are services every server registers.
var everywhere = []grpc.ServiceDesc{healthpb.Health_ServiceDesc, reflectionpb.ServerReflection_ServiceDesc}

// edges is the call graph restated from the services' mains: caller → server → the
// gRPC services it calls there. "" is a caller without a certificate.
var edges = map[string]map[string][]string{
	meshtls.Orchestrator: {
		meshtls.ModelProxy: {"curfew.modelproxy.v1.ModelProxyService", "curfew.mesh.v1.NodeReportService"},
		meshtls.ToolRunner: {"curfew.toolrunner.v1.ToolRunnerService", "curfew.mesh.v1.NodeReportService"},
		meshtls.Subagent:   {"curfew.mesh.v1.NodeReportService"},
	},
	meshtls.ToolRunner: {
		meshtls.Subagent: {"curfew.subagent.v1.SubagentService", "curfew.mesh.v1.NodeReportService"},
	},
	meshtls.Subagent: {
		meshtls.ModelProxy: {"curfew.modelproxy.v1.ModelProxyService", "curfew.mesh.v1.NodeReportService"},
		meshtls.ToolRunner: {"curfew.toolrunner.v1.ToolRunnerService", "curfew.mesh.v1.NodeReportService"},
	},
}

// allowed says whether caller may call method (of service) on server by the call graph.
func allowed(caller, server, service, method string) bool {
	switch {
	case server == meshtls.Orchestrator && strings.HasPrefix(service, "curfew.orchestrator.v1."):
		return true // public
	case caller == "":
		return false
	case service == "grpc.health.v1.Health" || strings.HasPrefix(service, "grpc.reflection."):
		return true
	case caller == meshtls.CLI:
		return server != meshtls.Orchestrator && service == "curfew.mesh.v1.NodeReportService" && method == "ListNodes"
	case service == "curfew.modelproxy.v1.ModelProxyService" && (method == "ListDecoders" || method == "CancelDecoders"):
		return caller == meshtls.Orchestrator // the admin API's fan-out, nobody else
	}
	return slices.Contains(edges[caller][server], service)
}

// TestDefaultPolicy checks every method every server serves against every caller.
func TestDefaultPolicy(t *testing.T) {
	callers := append([]string{""}, identities...)
	for server, descs := range served {
		pol, err := meshtls.DefaultPolicy(server)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range append(slices.Clone(descs), everywhere...) {
			var methods []string
			for _, md := range d.Methods {
				methods = append(methods, md.MethodName)
			}
			for _, sd := range d.Streams {
				methods = append(methods, sd.StreamName)
			}
			for _, method := range methods {
				full := "/" + d.ServiceName + "/" + method
				anyone := false
				for _, caller := range callers {
					ctx := peerContext(t)
					if caller != "" {
						ctx = peerContext(t, "spiffe://curfew.local/"+caller)
					}
					err := pol.Authorize(ctx, full)
					want := allowed(caller, server, d.ServiceName, method)
					anyone = anyone || want
					switch {
					case want && err != nil:
						t.Errorf("on %s, %q calling %s: %v; want allowed", server, caller, full, err)
					case !want && caller == "" && status.Code(err) != codes.Unauthenticated:
						t.Errorf("on %s, no identity calling %s: %v; want UNAUTHENTICATED", server, full, err)
					case !want && caller != "" && (status.Code(err) != codes.PermissionDenied || status.Convert(err).Message() != caller+" may not call "+full):
						t.Errorf("on %s, %s calling %s: %v; want PERMISSION_DENIED", server, caller, full, err)
					}
				}
				if !anyone {
					t.Errorf("on %s, nobody may call %s", server, full)
				}
			}
		}
	}
	if _, err := meshtls.DefaultPolicy("gateway"); err == nil {
		t.Error("DefaultPolicy of an unknown service")
	}
}

func TestNewPolicy(t *testing.T) {
	for _, bad := range []meshtls.Rule{
		{Method: "curfew.x.v1.X/", Callers: []string{meshtls.AnyPeer}},
		{Method: "/curfew.x.v1.X/"},
		{Method: "/curfew.x.v1.X/", Callers: []string{"Not An Identity"}},
	} {
		if _, err := meshtls.NewPolicy(bad); err == nil {
			t.Errorf("NewPolicy(%+v) took a bad rule", bad)
		}
	}
	pol, err := meshtls.NewPolicy(
		meshtls.Rule{Method: "/a.v1.S/Exact", Callers: []string{"x"}},
		meshtls.Rule{Method: "/a.v1.", Callers: []string{"y"}},
	)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		caller, method string
		want           codes.Code
	}{
		{"x", "/a.v1.S/Exact", codes.OK},
		{"x", "/a.v1.S/Exactly", codes.PermissionDenied},
		{"y", "/a.v1.S/Exact", codes.OK}, // rules add up
		{"y", "/a.v1.T/Other", codes.OK},
		{"y", "/a.v2.T/Other", codes.PermissionDenied},
	} {
		if got := status.Code(pol.Authorize(peerContext(t, "spiffe://curfew.local/"+tc.caller), tc.method)); got != tc.want {
			t.Errorf("%s calling %s: %v, want %v", tc.caller, tc.method, got, tc.want)
		}
	}
	if got := len(pol.Rules()); got != 2 {
		t.Errorf("Rules() has %d rules, want 2", got)
	}
}
