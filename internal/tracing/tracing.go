// Package tracing is Baton's OpenTelemetry tracing: off by default and then free (one atomic
// load per hook), on with --otlp-traces-endpoint or the standard OTEL_* variables. A request
// gets a server span; selection, every upstream attempt and each PD leg get spans under it; a
// leg's traceparent is its own span, so the engines' spans nest under the leg that called them.
package tracing

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

var (
	on     atomic.Bool
	tracer trace.Tracer = noop.NewTracerProvider().Tracer("baton")
	prop                = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})
)

// Enabled reports whether spans are made. Every hook checks it first.
func Enabled() bool { return on.Load() }

// Config says where spans go.
type Config struct {
	// Endpoint is the OTLP collector: http(s)://host:port[/v1/traces] for OTLP/HTTP, or
	// grpc://host:port for OTLP/gRPC. Empty: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
	// OTEL_EXPORTER_OTLP_ENDPOINT (with OTEL_EXPORTER_OTLP_PROTOCOL), or tracing stays off.
	Endpoint string
	// Ratio is the share of new traces sampled (a client's sampled traceparent is followed).
	Ratio   float64
	Version string
	// Watch, when set, is told of spans lost (and says so).
	Watch *Watch
}

// Setup starts tracing when cfg (or the environment) names a collector, and returns the
// function that flushes and stops it; with none, tracing stays off and shutdown does nothing.
func Setup(ctx context.Context, cfg Config) (shutdown func(context.Context) error, err error) {
	none := func(context.Context) error { return nil }
	endpoint, protocol := cfg.Endpoint, ""
	if endpoint == "" {
		endpoint = os.Getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
		if endpoint == "" {
			endpoint = os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT")
		}
		protocol = os.Getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
		if protocol == "" {
			protocol = os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
		}
		if endpoint == "" || os.Getenv("OTEL_SDK_DISABLED") == "true" || os.Getenv("OTEL_TRACES_EXPORTER") == "none" {
			return none, nil
		}
	}
	if !strings.Contains(endpoint, "://") {
		endpoint = "grpc://" + endpoint // smg's form, host:port: OTLP over gRPC (its default localhost:4317)
	}
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		return none, fmt.Errorf("otlp traces endpoint %q: want http(s)://host:port or grpc://host:port", endpoint)
	}
	var exp sdktrace.SpanExporter
	switch {
	case u.Scheme == "grpc" || protocol == "grpc":
		opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(u.Host)}
		if u.Scheme != "https" {
			opts = append(opts, otlptracegrpc.WithInsecure())
		}
		exp, err = otlptracegrpc.New(ctx, opts...)
	case u.Scheme == "http" || u.Scheme == "https":
		opts := []otlptracehttp.Option{otlptracehttp.WithEndpoint(u.Host)}
		if u.Scheme == "http" {
			opts = append(opts, otlptracehttp.WithInsecure())
		}
		if p := strings.TrimRight(u.Path, "/"); p != "" {
			opts = append(opts, otlptracehttp.WithURLPath(p))
		}
		exp, err = otlptracehttp.New(ctx, opts...)
	default:
		return none, fmt.Errorf("otlp traces endpoint %q: scheme must be http, https or grpc", endpoint)
	}
	if err != nil {
		return none, err
	}
	res, _ := resource.Merge(resource.Default(), resource.NewSchemaless(
		attribute.String("service.name", envOr("OTEL_SERVICE_NAME", "baton")), attribute.String("service.version", cfg.Version)))
	sampler := sdktrace.ParentBased(sdktrace.TraceIDRatioBased(cfg.Ratio))
	w := cfg.Watch
	if w == nil {
		w = &Watch{}
	}
	w.mu.Lock()
	w.state.Collector = u.Host
	w.mu.Unlock()
	bsp := sdktrace.NewBatchSpanProcessor(watchedExporter{SpanExporter: exp, w: w}, sdktrace.WithBatchTimeout(time.Second), sdktrace.WithMaxQueueSize(maxQueued))
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(boundedProcessor{SpanProcessor: bsp, w: w}), sdktrace.WithResource(res), sdktrace.WithSampler(sampler))
	otel.SetErrorHandler(otel.ErrorHandlerFunc(w.handle))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(prop)
	tracer = tp.Tracer("github.com/baton-llm/baton")
	on.Store(true)
	return func(ctx context.Context) error {
		on.Store(false)
		return tp.Shutdown(ctx)
	}, nil
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// StartServer starts a request's server span under ctx, continuing the traceparent of the
// client's headers h.
func StartServer(ctx context.Context, method, path string, h http.Header) (context.Context, trace.Span) {
	ctx = prop.Extract(ctx, propagation.HeaderCarrier(h))
	return tracer.Start(ctx, "baton "+method, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attribute.String("http.request.method", method), attribute.String("url.path", path)))
}

// Start starts an internal span under ctx's.
func Start(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	return tracer.Start(ctx, name, trace.WithAttributes(attrs...))
}

// StartClient starts a client span for an upstream call under ctx's and puts its traceparent
// into h (replacing the client's), so the engine's spans nest under it.
func StartClient(ctx context.Context, name string, h http.Header, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	ctx, span := tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(attrs...))
	h.Del("Traceparent")
	h.Del("Tracestate")
	prop.Inject(ctx, propagation.HeaderCarrier(h))
	return ctx, span
}

// Event adds an event to ctx's span (nothing when tracing is off).
func Event(ctx context.Context, name string, attrs ...attribute.KeyValue) {
	if Enabled() {
		trace.SpanFromContext(ctx).AddEvent(name, trace.WithAttributes(attrs...))
	}
}

// TraceID returns ctx's trace id, "" without a recording span.
func TraceID(ctx context.Context) string {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		return sc.TraceID().String()
	}
	return ""
}

type attemptKey struct{}

// WithAttempt records the attempt number of a request's try.
func WithAttempt(ctx context.Context, n int) context.Context {
	return context.WithValue(ctx, attemptKey{}, n)
}

// Attempt returns the attempt number recorded in ctx, 1 without one.
func Attempt(ctx context.Context) int {
	if n, ok := ctx.Value(attemptKey{}).(int); ok {
		return n
	}
	return 1
}
