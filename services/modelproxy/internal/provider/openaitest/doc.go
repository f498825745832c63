// Package openaitest is an HTTP test server that speaks the OpenAI chat completions API
// the way api.openai.com streams it, scripted per request by tests.
//
// A streamed reply is Server-Sent Events, each "data: {json}\n\n" with id, object
// "chat.completion.chunk", created, model, system_fingerprint and choices[{index,
// delta{role, content, refusal, tool_calls[{index, id, type "function", function{name,
// arguments}}]}, logprobs, finish_reason}]: first a role chunk, then one chunk per content
// token, then each tool call as a header chunk (id, type, name, empty arguments) followed
// by its argument fragments, then a chunk with an empty delta and the finish reason, then,
// when the request set stream_options.include_usage, a chunk with empty choices and the
// usage (every earlier chunk then carries "usage": null), and finally "data: [DONE]".
// A request without "stream": true gets one chat.completion object. Errors are the
// status with OpenAI's {"error": {message, type, param, code}} body.
//
// Tests script replies with Enqueue (one Reply per request, in order) or Handle (a
// function of the Request), pace them (Interval, FirstChunkDelay, HeaderDelay) and inject
// faults (Status with RetryAfter, StreamError, Reset, Hang, NoDone). The server records
// every Call: the decoded request and its headers, and what happened to the reply,
// including whether the client went away before its end, when the server saw it go
// (GoneAt) and how many chunks it wrote after that (ChunksAfterGone; 0 for a server that
// stops decoding on disconnect, as this one does unless IgnoreDisconnect is set).
//
//	srv := openaitest.New(t)
//	srv.Enqueue(openaitest.Reply{Content: openaitest.Tokens(20), Interval: 5 * time.Millisecond})
//	p, _ := provider.NewOpenAI(provider.OpenAIConfig{Name: "test", BaseURL: srv.URL()})
//	...
//	call, _ := srv.Wait(ctx, 0) // the first request, once its handler has returned
//
// For tests over real processes, cmd/openaitest runs the server standalone; the same
// server always serves a small control API under /_openaitest/ (see Server.ServeHTTP).
package openaitest
