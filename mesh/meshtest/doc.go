// Package meshtest holds helpers for tests of curfew's mesh and services: real gRPC
// servers on loopback with curfew's interceptor chain, scripted fakes of the services the
// agent loop calls, the checks the services' tests share, and a harness for the service
// commands' flag handling.
//
// The servers and fakes run over real gRPC on 127.0.0.1, never a mock of the transport,
// and clean up with t.Cleanup so that tests can check for goroutine leaks.
//
//   - [Serve] starts a grpc.Server with mesh.ServerOptions and returns a client
//     connection with mesh.DialOptions.
//   - [Model] is a scripted curfew.modelproxy.v1.ModelProxyService; [Tools] a scripted
//     curfew.toolrunner.v1.ToolRunnerService. Both record every call ([Call]) and serve
//     curfew.mesh.v1.NodeReportService from a real nodes.Table (the node begins when a
//     call starts and ends when its handler returns), so a caller's settle and
//     CancelNodes work as they do against the real services.
//   - [WaitNode] waits for a node to end in a nodes.Table; [WantCode] checks an error's
//     gRPC status; [Drain] reads a server stream to its end.
//   - [RunMain] runs a command's run function with stderr captured; [RunFlagCases] checks
//     that it refuses command lines as usage errors, among them the [CommonFlagCases] of
//     the flags every service shares.
package meshtest
