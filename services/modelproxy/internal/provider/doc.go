// Package provider is modelproxy's view of an upstream inference service: a streamed
// completion with tool calls and usage, and errors as gRPC statuses that say whether the
// provider or the request is at fault. The OpenAI-compatible implementation lives in
// openai.go; the built-in sim model is package sim.
package provider
