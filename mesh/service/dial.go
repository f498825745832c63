package service

import (
	"io"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/replicas"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// Dial returns a client connection to target with the mesh client chain and default
// retries, over creds (Runtime.Credentials; nil: plaintext). Connections are lazy, so
// services that call each other can start in any order.
func Dial(target string, creds credentials.TransportCredentials) (*grpc.ClientConn, error) {
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	opts := append(mesh.DialOptions(mesh.ClientConfig{}), grpc.WithTransportCredentials(creds))
	return grpc.NewClient(target, opts...)
}

// Dial returns a client connection to the service name at target with the mesh client
// chain, this service's retry policy for that target, its retry windows when
// CoordinateRetries made them, and the breaker of name from rt.Breakers (metrics on the
// admin port). Connections dialled with one name share its breaker. With --tls-dir the
// connection is mTLS (Credentials(name)): name must then be the server's mesh identity.
func (rt *Runtime) Dial(name, target string) (*grpc.ClientConn, error) {
	rc := rt.retries.For(name)
	rc.Metrics, rc.Logger = rt.retryMetrics, rt.Log
	rt.retryMetrics.Known(name, packageMethods("curfew."+name+".v1")...)
	if rt.windows != nil {
		rc.Window = rt.windows
		rt.windows.Known(name)
	}
	opts := append(mesh.DialOptions(mesh.ClientConfig{Retry: rc, Breakers: rt.Breakers, Metrics: rt.metrics.client}), grpc.WithTransportCredentials(rt.Credentials(name)),
		rt.clientTracing())
	return grpc.NewClient(target, opts...)
}

// ClientOptions returns the mesh client chain for a connection to a server outside the
// call graph (a team's tool server): this service's client metrics and tracing, and
// retries as rc says (its Target labels them); no breaker and no transport credentials,
// which are the caller's to add.
func (rt *Runtime) ClientOptions(rc retry.Config) []grpc.DialOption {
	if rc.Logger == nil {
		rc.Logger = rt.Log
	}
	return append(mesh.DialOptions(mesh.ClientConfig{Retry: rc, Metrics: rt.metrics.client}), rt.clientTracing())
}

// NodeReports returns the node report client of the service name at target that asks
// every replica (package replicas): with a dns:/// target (a headless Service), each
// address the name resolves to; otherwise the target alone. A run's nodes are in the
// tables of the replicas that ran them, so cancel broadcasts, summaries and teardown
// waits must reach them all, where the connection Dial makes reaches one per call. Its
// connections have the mesh client chain, name's retry policy, metrics and tracing, but
// not name's breaker: one replica's failures must not open the breaker of the calls that
// any replica can serve. Close the returned closer when done.
func (rt *Runtime) NodeReports(name, target string) (meshv1.NodeReportServiceClient, io.Closer, error) {
	set, err := rt.Replicas(name, target, meshv1.NodeReportService_ServiceDesc)
	if err != nil {
		return nil, nil, err
	}
	return replicas.NodeReports(set), set, nil
}

// Replicas returns the Set of every replica of the service name at target (package
// replicas), with connections as NodeReports makes them; the methods of services are
// known to the retry metrics from the start. A caller that fans out more than node
// reports (the orchestrator's decoder leases, to every modelproxy) makes its node
// reports with replicas.NodeReports on the same Set. Close the Set when done.
func (rt *Runtime) Replicas(name, target string, services ...grpc.ServiceDesc) (*replicas.Set, error) {
	rc := rt.retries.For(name)
	rc.Metrics, rc.Logger = rt.retryMetrics, rt.Log
	for _, d := range services {
		rt.retryMetrics.Known(name, descMethods(d)...)
	}
	dial := func(addr string) (*grpc.ClientConn, error) {
		opts := append(mesh.DialOptions(mesh.ClientConfig{Retry: rc, Metrics: rt.metrics.client}), grpc.WithTransportCredentials(rt.Credentials(name)),
			rt.clientTracing())
		return grpc.NewClient(addr, opts...)
	}
	return replicas.New(target, dial, replicas.WithLogger(rt.Log))
}

// packageMethods are the full method names of the services of proto package pkg linked
// into this binary: a mesh service name's API is the package curfew.<name>.v1, so a
// connection's methods, and the series of their metrics, are known before any call.
func packageMethods(pkg string) []string {
	var out []string
	protoregistry.GlobalFiles.RangeFilesByPackage(protoreflect.FullName(pkg), func(f protoreflect.FileDescriptor) bool {
		for i := range f.Services().Len() {
			svc := f.Services().Get(i)
			for j := range svc.Methods().Len() {
				out = append(out, "/"+string(svc.FullName())+"/"+string(svc.Methods().Get(j).Name()))
			}
		}
		return true
	})
	return out
}

// descMethods are the full method names of a service.
func descMethods(d grpc.ServiceDesc) []string {
	var out []string
	for _, m := range d.Methods {
		out = append(out, "/"+d.ServiceName+"/"+m.MethodName)
	}
	for _, s := range d.Streams {
		out = append(out, "/"+d.ServiceName+"/"+s.StreamName)
	}
	return out
}

// serverMethods are the full method names of the services registered on s, but gRPC's
// own (health, reflection), which carry no retry-id.
func serverMethods(s *grpc.Server) []string {
	var out []string
	for name, info := range s.GetServiceInfo() {
		if strings.HasPrefix(name, "grpc.") {
			continue
		}
		for _, m := range info.Methods {
			out = append(out, "/"+name+"/"+m.Name)
		}
	}
	return out
}
