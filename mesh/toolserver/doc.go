// Package toolserver serves Go functions as curfew tools: a curfew.tool.v1.ToolService
// that toolrunner lists and calls over gRPC like any team's tool server.
//
//	srv := toolserver.New(toolserver.Tool{
//		Name:        "lookup",
//		Description: "Looks an order up by its id.",
//		InputSchema: json.RawMessage(`{"type":"object","properties":{"id":{"type":"string"}},"required":["id"]}`),
//		SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
//		Handler:     lookup,
//	})
//	gs := grpc.NewServer(mesh.ServerOptions(mesh.ServerConfig{Logger: logger})...)
//	srv.Register(gs)
//	gs.Serve(lis)
//
// # What a handler sees
//
// A Handler runs under a context that carries the call's gRPC deadline (the run's, as
// toolrunner sent it) and ends when the call does: when toolrunner cancels the node it
// resets the stream (RST_STREAM), and the context is cancelled with the cause
// [ErrCancelled] (wrapping the cause mesh's server chain gave, if any: a newer attempt of
// the same retry-id supersedes this one); when the deadline passes, with the cause
// [ErrDeadline].
// context.Cause tells the two apart (both also match context.Canceled and
// context.DeadlineExceeded respectively with errors.Is). A handler should return soon
// after; whatever it returns then is not sent, as nobody is listening.
//
// [Call] holds the arguments and what curfew tells the tool about the call, read from
// the request's metadata (package md): run, node, retry-id, attempt, idempotency key
// and the absolute deadline of curfew-deadline. A tool with irreversible effects does
// its effect at most once per Call.IdempotencyKey.
//
// progress reports how far the tool has come; each call sends a progress event to
// toolrunner, which forwards it to whoever watches the run. It is safe for concurrent
// use, and calls made after the handler returned are ignored.
//
// # Errors
//
// A tool that fails in its own terms (the order does not exist, the input makes no
// sense to it) returns [ToolError]: the caller receives a result with is_error and the
// text, and a model is shown it. Any other error fails the call with a gRPC status: a
// status error (status.Error) as it is, a context error as CANCELLED or
// DEADLINE_EXCEEDED, anything else as grpc-go sends a plain error (UNKNOWN with its
// text), or, under mesh's server chain, as INTERNAL with the text only logged.
//
// The server itself answers NOT_FOUND for a tool it does not have and INVALID_ARGUMENT
// for arguments that are not a JSON object. Empty arguments are taken as {}. A handler
// that returns output that is not JSON fails the call with INTERNAL.
//
// # Server options
//
// Register adds the service to a *grpc.Server the caller builds, so the server's
// options are the caller's. Inside curfew's mesh, build it with mesh.ServerOptions:
// mTLS credentials, the call log, panic recovery, the deadline and identity layers and
// the status mapping, the same chain as every curfew service. Outside it, plain
// grpc.NewServer() (plaintext) or grpc.NewServer(grpc.Creds(...)) serves toolrunner
// just as well: the handler reads curfew's facts from the metadata either way.
package toolserver
