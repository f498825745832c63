// Package md defines curfew's metadata contract: the header names every hop sends, and
// the context values they become on the receiving side.
//
// Every header name is an exported constant here and nowhere else. The server side of
// the interceptor chain (package mesh) reads the incoming headers into an [Identity] on
// the context; the client side writes the context's Identity and deadline back out, so
// a handler that calls another service propagates run, tenant and node without doing
// anything itself. To address a child node, derive a context with [WithNode].
package md
