package meshtest

import (
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// Serve starts a gRPC server on 127.0.0.1:0 with curfew's server chain (cfg), lets
// register add services to it, and returns an insecure client connection to it with
// curfew's client chain (retries off). t.Cleanup closes the connection and stops the server, waiting
// for its handlers to return, so handlers must honour their context.
func Serve(t testing.TB, cfg mesh.ServerConfig, register func(*grpc.Server)) *grpc.ClientConn {
	t.Helper()
	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("meshtest: listen: %v", err)
	}
	opts := append(mesh.ServerOptions(cfg), grpc.WaitForHandlers(true))
	srv := grpc.NewServer(opts...)
	if register != nil {
		register(srv)
	}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(lis)
	}()
	conn, err := dial(lis.Addr().String())
	if err != nil {
		srv.Stop()
		<-served
		t.Fatalf("meshtest: dial %s: %v", lis.Addr(), err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		srv.Stop()
		<-served
	})
	return conn
}

// dial returns an insecure client connection to target with curfew's client chain,
// retries off: a test of a server sees exactly the attempts it makes. The caller closes it.
func dial(target string) (*grpc.ClientConn, error) {
	ccfg := mesh.ClientConfig{Retry: retry.Config{Default: retry.Policy{Disabled: true}}}
	opts := append(mesh.DialOptions(ccfg), grpc.WithTransportCredentials(insecure.NewCredentials()))
	return grpc.NewClient(target, opts...)
}
