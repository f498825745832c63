package tracing

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Environment variables read here. The OTLP exporters and the SDK read the rest of the
// standard ones themselves (endpoint, headers, timeout, TLS, compression, the sampler,
// the batch processor's limits, resource attributes).
const (
	EnvSDKDisabled       = "OTEL_SDK_DISABLED"
	EnvTracesExporter    = "OTEL_TRACES_EXPORTER"
	EnvEndpoint          = "OTEL_EXPORTER_OTLP_ENDPOINT"
	EnvTracesEndpoint    = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
	EnvProtocol          = "OTEL_EXPORTER_OTLP_PROTOCOL"
	EnvTracesProtocol    = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
	DefaultProtocol      = "http/protobuf" // the OpenTelemetry specification's default
	exporterOTLP         = "otlp"
	exporterConsole      = "console"
	exporterNone         = "none"
	serviceNameKey       = attribute.Key("service.name")
	instrumentationScope = "github.com/curfew-mesh/curfew/mesh/tracing"
)

// Enabled reports whether the environment asks for traces: OTEL_TRACES_EXPORTER names an
// exporter other than none, or an OTLP endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), and OTEL_SDK_DISABLED is not true. Unlike the
// OpenTelemetry default (an unset OTEL_TRACES_EXPORTER means otlp to localhost), nothing
// is exported when none of them is set: a mesh started without configuration sends
// nothing anywhere.
func Enabled(getenv func(string) string) bool {
	if strings.EqualFold(strings.TrimSpace(getenv(EnvSDKDisabled)), "true") {
		return false
	}
	switch exp := strings.TrimSpace(getenv(EnvTracesExporter)); exp {
	case exporterNone:
		return false
	case "":
		return getenv(EnvEndpoint) != "" || getenv(EnvTracesEndpoint) != ""
	}
	return true
}

// Propagator is the context propagation of the mesh: W3C tracecontext and baggage.
func Propagator() propagation.TextMapPropagator {
	return propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
}

// Provider is a process's tracer provider. The nil *Provider and a Provider made with
// tracing off are no-op: they record nothing, and their handlers only propagate context.
type Provider struct {
	tp  trace.TracerProvider
	sdk *sdktrace.TracerProvider // nil when off
}

// WithSDK returns a provider over an SDK tracer provider built by the caller (tests, or a
// program that configures its exporters in code). Shutdown shuts tp down.
func WithSDK(tp *sdktrace.TracerProvider) *Provider { return &Provider{tp: tp, sdk: tp} }

// Off returns a no-op provider.
func Off() *Provider { return &Provider{tp: noop.NewTracerProvider()} }

// FromEnv returns the provider the environment configures for the process named
// service (see Enabled): when on, an SDK provider exporting through a batch processor to
// the exporters of OTEL_TRACES_EXPORTER (otlp when unset; console; comma-separated for
// several), OTLP over OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL
// (http/protobuf when unset, or grpc), sampled by OTEL_TRACES_SAMPLER (parent-based
// always-on when unset). Its resource is OTEL_RESOURCE_ATTRIBUTES and the SDK's own,
// with service.name = service: the four services share one environment under `curfew
// up`, so OTEL_SERVICE_NAME does not rename them. getenv is os.Getenv when nil; the
// exporters themselves read the process environment.
func FromEnv(ctx context.Context, service string, getenv func(string) string) (*Provider, error) {
	if getenv == nil {
		getenv = os.Getenv
	}
	if !Enabled(getenv) {
		return Off(), nil
	}
	exps, err := exporters(ctx, getenv)
	if err != nil {
		return nil, err
	}
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(serviceNameKey.String(service)))
	if err != nil {
		return nil, fmt.Errorf("tracing: resource: %w", err)
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	for _, e := range exps {
		opts = append(opts, sdktrace.WithBatcher(e))
	}
	sdk := sdktrace.NewTracerProvider(opts...)
	return &Provider{tp: sdk, sdk: sdk}, nil
}

// exporters returns the span exporters of OTEL_TRACES_EXPORTER.
func exporters(ctx context.Context, getenv func(string) string) ([]sdktrace.SpanExporter, error) {
	names := strings.TrimSpace(getenv(EnvTracesExporter))
	if names == "" {
		names = exporterOTLP
	}
	var out []sdktrace.SpanExporter
	for name := range strings.SplitSeq(names, ",") {
		var e sdktrace.SpanExporter
		var err error
		switch name = strings.TrimSpace(name); name {
		case exporterOTLP:
			e, err = otlp(ctx, getenv)
		case exporterConsole:
			e, err = stdouttrace.New(stdouttrace.WithWriter(os.Stderr))
		case exporterNone, "":
			continue
		default:
			err = fmt.Errorf("%s=%q: unknown exporter %q (otlp, console or none)", EnvTracesExporter, names, name)
		}
		if err != nil {
			for _, prev := range out {
				_ = prev.Shutdown(ctx)
			}
			return nil, fmt.Errorf("tracing: %w", err)
		}
		out = append(out, e)
	}
	return out, nil
}

// otlp returns the OTLP exporter of the configured protocol. The exporter reads its
// endpoint, headers, timeout, TLS and compression from the OTEL_EXPORTER_OTLP_* variables.
func otlp(ctx context.Context, getenv func(string) string) (sdktrace.SpanExporter, error) {
	proto := strings.TrimSpace(getenv(EnvTracesProtocol))
	if proto == "" {
		proto = strings.TrimSpace(getenv(EnvProtocol))
	}
	switch proto {
	case "", DefaultProtocol:
		return otlptracehttp.New(ctx)
	case "grpc":
		return otlptracegrpc.New(ctx)
	}
	return nil, fmt.Errorf("OTLP protocol %q is not supported (grpc or http/protobuf)", proto)
}

// Enabled reports whether p records and exports spans.
func (p *Provider) Enabled() bool { return p != nil && p.sdk != nil }

// TracerProvider returns p's tracer provider (a no-op one for the nil Provider).
func (p *Provider) TracerProvider() trace.TracerProvider {
	if p == nil {
		return noop.NewTracerProvider()
	}
	return p.tp
}

// ForceFlush exports every span ended so far, within ctx.
func (p *Provider) ForceFlush(ctx context.Context) error {
	if !p.Enabled() {
		return nil
	}
	return p.sdk.ForceFlush(ctx)
}

// Shutdown flushes the spans ended so far and stops the exporters, within ctx. Spans
// ended after it are dropped.
func (p *Provider) Shutdown(ctx context.Context) error {
	if !p.Enabled() {
		return nil
	}
	err := p.sdk.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("tracing: spans not exported within the shutdown bound: %w", err)
	}
	return err
}
