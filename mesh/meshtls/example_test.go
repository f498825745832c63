package meshtls_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// Example shows curfew up's part (a CA and the certificates) and the wiring of a server
// (toolrunner) and of a client (orchestrator) dialling it.
func Example() {
	dir, err := os.MkdirTemp("", "curfew-tls")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	// curfew up: the CA and one certificate per identity.
	ca, err := meshtls.EnsureCA(dir)
	if err != nil {
		log.Fatal(err)
	}
	for _, id := range []string{meshtls.Orchestrator, meshtls.ToolRunner} {
		if err := ca.Issue(dir, id, 0); err != nil {
			log.Fatal(err)
		}
	}

	// The toolrunner's server: its certificate, client certificates required, and its
	// edges of the call graph.
	src, err := meshtls.NewSource(dir, meshtls.ToolRunner)
	if err != nil {
		log.Fatal(err)
	}
	pol, err := meshtls.DefaultPolicy(meshtls.ToolRunner)
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(meshtls.ServerCredentials(src, meshtls.RequireClientCert)),
		grpc.ChainUnaryInterceptor(pol.UnaryServerInterceptor()), grpc.ChainStreamInterceptor(pol.StreamServerInterceptor()))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	lis, err := new(net.ListenConfig).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	defer srv.Stop()

	// The orchestrator's client of toolrunner.
	osrc, err := meshtls.NewSource(dir, meshtls.Orchestrator)
	if err != nil {
		log.Fatal(err)
	}
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(meshtls.ClientCredentials(osrc, meshtls.ToolRunner)))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	resp, err := healthpb.NewHealthClient(conn).Check(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(resp.GetStatus())
	// Output: SERVING
}
