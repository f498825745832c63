// Package client is a Go client of curfew's public API, the orchestrator's
// curfew.orchestrator.v1.OrchestratorService (docs/api.md): start runs and stream their
// events, start detached runs idempotently, watch, read, list and cancel runs.
//
//	c, err := client.New("orchestrator.example:7700", client.WithAPIKey(os.Getenv("CURFEW_API_KEY")))
//	...
//	defer c.Close()
//	ctx, cancel := context.WithTimeout(ctx, time.Minute) // the run's deadline
//	defer cancel()
//	run, err := c.RunAndWait(ctx, client.Request{Task: plan})
//
// # Connecting
//
// New takes the orchestrator's gRPC target. By default it connects over TLS verified with
// the system's roots; WithTLS takes a tls.Config of the caller's (for a mesh's own CA,
// RootCAs from DATA_DIR/tls/ca.crt), WithMeshTLS connects with mTLS as a mesh identity
// (the files `curfew up` writes), WithInsecure in plaintext (`curfew up --insecure`).
//
// Every call acts for one tenant, which the server decides: WithAPIKey's key names it. A
// mesh peer without a key (WithMeshTLS as curfew-cli) acts for the tenant of its
// curfew-tenant header, "default" without one; this package sends none, since only mesh
// peers may claim a tenant (an operator's tool can add the header to ctx with
// metadata.AppendToOutgoingContext). The key is never sent in plaintext to a non-loopback
// target: New refuses WithAPIKey with WithInsecure unless the target is localhost, a
// loopback IP or a unix socket.
//
// # Deadlines and cancellation
//
// The ctx of a call is the call's: its deadline travels as the gRPC deadline (and as
// curfew-deadline), and for Run it is the run's absolute deadline. Cancelling the ctx of a
// Run, or closing its Stream, resets the HTTP/2 stream, which the orchestrator takes as
// the client leaving: the run is cancelled with cause client_disconnect unless
// Request.ContinueOnDisconnect.
//
// # Retries
//
// The client uses the mesh's own client chain (mesh.DialOptions) and so retries exactly as
// docs/retries.md describes for every hop of the mesh: a retry-id minted once per logical
// call (mesh/retry, a UUIDv7) and sent unchanged on each attempt as curfew-retry-id, with
// curfew-attempt numbering them; at most 3 attempts with full-jitter backoff (base 25 ms,
// cap 250 ms); only UNAVAILABLE, and RESOURCE_EXHAUSTED when the server pushed back
// (RetryInfo or grpc-retry-pushback-ms, whose delay replaces the backoff); never an error
// marked RETRIES_EXHAUSTED (it was retried to exhaustion below); never a wait past the
// deadline (DEADLINE_EXCEEDED "no time left to retry"); a retry budget of 20 % of calls
// plus 10 per second. Which calls: Get, List, Watch and Cancel; Start only with an
// idempotency key; Run and Watch only before their first event, since after the run has
// started a retry of Run would start a second one. An error retried to exhaustion is
// returned with the RETRIES_EXHAUSTED ErrorInfo: do not retry it again. WithoutRetries
// turns retries off.
//
// # Errors
//
// Errors are gRPC statuses as the server sent them, except New's configuration errors:
// read them with status.Code, and RetryInfo and ErrorInfo with
// status.Convert(err).Details(). What each code means is in docs/status-codes.md; the
// codes a caller should expect:
//
//   - every call: UNAUTHENTICATED (no key, or a wrong, unknown or revoked one),
//     UNAVAILABLE (orchestrator unreachable or draining; already retried),
//     DEADLINE_EXCEEDED, CANCELLED (ctx cancelled), RESOURCE_EXHAUSTED with RetryInfo (the
//     tenant's request rate), INVALID_ARGUMENT (a malformed curfew-* header or field).
//   - Run, RunAndWait and Start: INVALID_ARGUMENT (a bad plan, naming the field; for Run,
//     a Request.Timeout, refused before any call), RESOURCE_EXHAUSTED with RetryInfo and
//     a SHED_<REASON> ErrorInfo (admission shed the run), OUT_OF_RANGE (a deadline over the tenant's max_deadline). After the Finished
//     event, Run's call ends with the run's status: DEADLINE_EXCEEDED, CANCELLED, or
//     the failure's code (run.ErrorCode names it).
//   - Start: ALREADY_EXISTS (the key reused with another task or model).
//   - Watch, Get, Cancel: NOT_FOUND (unknown run, or another tenant's).
//   - List: INVALID_ARGUMENT (a bad page token).
//
// Any method may return ABORTED when two calls share a retry-id, which this package never
// does, and INTERNAL for a server bug.
package client
