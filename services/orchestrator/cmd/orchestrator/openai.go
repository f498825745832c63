package main

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/toollist"
	"github.com/curfew-mesh/curfew/services/orchestrator/internal/openaiapi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// serveOpenAI serves the OpenAI-compatible API of cfg (its default model and grace) on
// addr. Its calls go to this orchestrator's own gRPC listener, so they pass the same
// server chain (API keys, request rate, admission, deadlines) as every other client's;
// the loopback connection adds no retries, since a retried Run would start the agent
// again. The returned func stops the listener: with the drain, no new completions, and
// those in flight end with their runs' streams.
func serveOpenAI(ctx context.Context, rt *service.Runtime, cfg openaiapi.Config, addr string, keys *apikey.Authenticator,
	tools toolrunnerv1.ToolRunnerServiceClient, models modelproxyv1.ModelProxyServiceClient) (func(), error) {
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	cc, err := grpc.NewClient(loopback(rt.Addr()), grpc.WithTransportCredentials(rt.Credentials(meshtls.Orchestrator)))
	if err != nil {
		_ = lis.Close()
		return nil, err
	}
	cfg.Orchestrator = orchestratorv1.NewOrchestratorServiceClient(cc)
	cfg.Models, cfg.Registered, cfg.Log = listModels(keys, models), registered(keys, tools), rt.Log
	h := openaiapi.New(cfg)
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			rt.Log.Error("openai front door", "error", err.Error())
		}
	}()
	rt.Log.Info("OpenAI-compatible API listening", "openai_addr", lis.Addr().String())
	return func() {
		// Shutdown closes the listener at once and waits, in the background so as not to
		// hold the drain, for the completions in flight: each ends with its run's stream.
		go func() {
			sctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), rt.StopDeadline())
			defer cancel()
			_ = srv.Shutdown(sctx)
			_ = cc.Close()
		}()
	}, nil
}

// keyTenant returns the tenant of an API key, checked as the orchestrator's server chain
// checks it; keys is nil without a store, where no key is valid.
func keyTenant(ctx context.Context, keys *apikey.Authenticator, key string) (string, error) {
	if keys == nil {
		return "", status.Error(codes.Unauthenticated, "this orchestrator keeps no API keys (it runs without a store)")
	}
	return keys.KeyTenant(ctx, key)
}

// asTenant is ctx for the orchestrator's own call acting for tenant: none of the HTTP
// request's outgoing metadata (its bearer key) goes to the callee.
func asTenant(ctx context.Context, tenant string) context.Context {
	return md.WithIdentity(metadata.NewOutgoingContext(ctx, metadata.MD{}), md.Identity{Tenant: tenant})
}

// listModels returns the front door's model list: modelproxy's ListModels, asked
// through the mesh's client chain once the key is checked.
func listModels(keys *apikey.Authenticator, models modelproxyv1.ModelProxyServiceClient) func(context.Context, string) ([]openaiapi.Model, error) {
	return func(ctx context.Context, key string) ([]openaiapi.Model, error) {
		tenant, err := keyTenant(ctx, keys, key)
		if err != nil {
			return nil, err
		}
		resp, err := models.ListModels(asTenant(ctx, tenant), &modelproxyv1.ListModelsRequest{})
		if err != nil {
			return nil, err
		}
		var out []openaiapi.Model
		for _, m := range resp.GetModels() {
			out = append(out, openaiapi.Model{ID: m.GetName(), OwnedBy: m.GetProvider()})
		}
		return out, nil
	}
}

// registered returns the front door's tools rule: the names of the tools the tenant of an
// API key may use, as the agent loop learns them (the process's toollist.Lister of the
// same toolrunner client, asked for that tenant), so that a request may name exactly
// the tools its run's model could be told of. keys is nil without a store, where no key
// is valid.
func registered(keys *apikey.Authenticator, tools toolrunnerv1.ToolRunnerServiceClient) func(context.Context, string) (map[string]bool, error) {
	lister := toollist.Shared(tools)
	return func(ctx context.Context, key string) (map[string]bool, error) {
		tenant, err := keyTenant(ctx, keys, key)
		if err != nil {
			return nil, err
		}
		list := lister.Tools(asTenant(ctx, tenant))
		if !list.Listed() {
			return nil, status.Error(codes.Unavailable, "toolrunner did not list the tools; retry")
		}
		names := map[string]bool{}
		for _, s := range list.Specs() {
			names[s.GetName()] = true
		}
		return names, nil
	}
}

// loopback is addr with an unspecified host ("[::]:7700") made 127.0.0.1.
func loopback(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		return net.JoinHostPort("127.0.0.1", port)
	}
	return addr
}
