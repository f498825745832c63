package toolserver_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
)

// A tool server of one tool, served on a loopback port and called the way toolrunner
// calls it: curfew's metadata, a deadline, progress events, then the result.
func Example() {
	greet := toolserver.Tool{
		Name:        "greet",
		Description: "Greets someone by name.",
		InputSchema: json.RawMessage(`{"type":"object","properties":{"name":{"type":"string"}},"required":["name"]}`),
		SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
		Handler: func(ctx context.Context, call toolserver.Call, progress func(done, total float64, msg string)) (json.RawMessage, error) {
			var in struct{ Name string }
			if err := json.Unmarshal(call.Args, &in); err != nil {
				return nil, toolserver.ToolError("arguments: " + err.Error())
			}
			if in.Name == "" {
				return nil, toolserver.ToolError("nobody to greet")
			}
			progress(1, 1, "greeted")
			return json.Marshal(map[string]string{"greeting": "hello, " + in.Name, "run": call.RunID})
		},
	}
	// Inside the mesh: grpc.NewServer(mesh.ServerOptions(mesh.ServerConfig{...})...).
	gs := grpc.NewServer()
	toolserver.New(greet).Register(gs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	go func() { _ = gs.Serve(lis) }()
	defer gs.Stop()

	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		panic(err)
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "curfew-run-id", "run-1")
	stream, err := toolv1.NewToolServiceClient(conn).CallTool(ctx, &toolv1.CallToolRequest{Name: "greet", ArgumentsJson: `{"name":"Ada"}`})
	if err != nil {
		panic(err)
	}
	for {
		ev, err := stream.Recv()
		if err != nil {
			panic(err)
		}
		if p := ev.GetProgress(); p != nil {
			fmt.Println("progress:", p.GetMessage())
			continue
		}
		fmt.Println("result:", ev.GetResult().GetOutputJson())
		return
	}
	// Output:
	// progress: greeted
	// result: {"greeting":"hello, Ada","run":"run-1"}
}
