package main

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/services/orchestrator/internal/openaiapi"
	"google.golang.org/grpc"
)

// serveOpenAI serves the OpenAI-compatible API on addr. Its calls go to this
// orchestrator's own gRPC listener, so they pass the same server chain (API keys,
// request rate, admission, deadlines) as every other client's; the loopback connection
// adds no retries, since a retried Run would start the agent again. The returned func
// stops the listener: with the drain, no new completions, and those in flight end with
// their runs' streams.
func serveOpenAI(ctx context.Context, rt *service.Runtime, addr, model string, tools toolrunnerv1.ToolRunnerServiceClient) (func(), error) {
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
	models := []string{model}
	if model != agent.DefaultModel {
		models = append(models, agent.DefaultModel)
	}
	h := openaiapi.New(openaiapi.Config{
		Orchestrator: orchestratorv1.NewOrchestratorServiceClient(cc),
		Models:       models,
		Registered: func(ctx context.Context) (map[string]bool, error) {
			res, err := tools.ListTools(ctx, &toolrunnerv1.ListToolsRequest{})
			if err != nil {
				return nil, err
			}
			names := map[string]bool{}
			for _, t := range res.GetTools() {
				names[t.GetName()] = true
			}
			return names, nil
		},
		Log: rt.Log,
	})
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
