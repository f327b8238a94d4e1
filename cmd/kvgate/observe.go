package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/kvgate/kvgate/gateway"
	"github.com/kvgate/kvgate/scheduler"
)

// newLogger returns serve's logger: slog's text or JSON handler at level,
// with the request id (and trace) of any record logged with a request's
// context.
func newLogger(w io.Writer, level string, format ...string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log_level %q: write debug, info, warn or error", level)
	}
	if w == nil {
		w = io.Discard
	}
	opts := &slog.HandlerOptions{Level: l}
	f := ""
	if len(format) > 0 {
		f = format[0]
	}
	var h slog.Handler
	switch f {
	case "", "text":
		h = slog.NewTextHandler(w, opts)
	case "json":
		h = slog.NewJSONHandler(w, opts)
	default:
		return nil, fmt.Errorf("log_format %q: write text or json", f)
	}
	return slog.New(gateway.LogHandler(h)), nil
}

// setupTracing installs the OTLP/HTTP trace exporter as the global
// provider when an endpoint is configured; tracing is off (a no-op
// provider) otherwise. The returned func flushes and stops it.
func setupTracing(cfg *config, log *slog.Logger) (func(context.Context) error, error) {
	if cfg.Tracing.OTLPEndpoint == "" {
		return func(context.Context) error { return nil }, nil
	}
	u, err := url.Parse(cfg.Tracing.OTLPEndpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("tracing.otlp_endpoint %q: write an http:// or https:// URL such as http://collector:4318", cfg.Tracing.OTLPEndpoint)
	}
	if u.Path == "" || u.Path == "/" {
		u.Path = "/v1/traces" // OTLP/HTTP's traces path under a collector's base URL
	}
	exp, err := otlptracehttp.New(context.Background(), otlptracehttp.WithEndpointURL(u.String()))
	if err != nil {
		return nil, fmt.Errorf("tracing: %w", err)
	}
	ratio := 1.0
	if cfg.Tracing.SampleRatio != nil {
		ratio = *cfg.Tracing.SampleRatio
	}
	res := resource.NewSchemaless(attribute.String("service.name", cfg.Tracing.ServiceName),
		attribute.String("service.version", readBuildInfo().Version))
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exp, sdktrace.WithBatchTimeout(time.Second)),
		sdktrace.WithResource(res),
		sdktrace.WithIDGenerator(scheduler.IDGenerator()),
		sdktrace.WithSampler(sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio))),
	)
	prevTP, prevProp := otel.GetTracerProvider(), otel.GetTextMapPropagator()
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	log.Info("tracing: exporting spans over OTLP/HTTP", "endpoint", u.Redacted(), "sample_ratio", ratio)
	return func(ctx context.Context) error {
		err := tp.Shutdown(ctx)
		otel.SetTracerProvider(prevTP)
		otel.SetTextMapPropagator(prevProp)
		return err
	}, nil
}
