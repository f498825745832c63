// Package openaiapi is the orchestrator's OpenAI-compatible front door: an HTTP server of
// POST /v1/chat/completions and GET /v1/models whose every completion is a curfew run.
//
// It calls the orchestrator's Run over a loopback gRPC connection to the orchestrator's
// own listener, through the same server chain as any external client: the bearer key is
// forwarded as the call's API key, so authentication, per-tenant rate and admission,
// deadline defaults and caps are those of gRPC, unchanged. The HTTP request's context is
// the call's, so a client that goes away cancels the run's whole tree (cause
// client_disconnect), streaming or not. docs/openai.md describes the API.
package openaiapi
