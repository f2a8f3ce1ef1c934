package app

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"

	"strconv"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/h1"
	"github.com/baton-llm/baton/internal/server"
)

// RunEPP runs `baton epp` with args until ctx ends: Baton as a Gateway API Inference Extension
// Endpoint Picker, the ext_proc and gRPC health services on --grpc-port beside the usual HTTP
// listeners (status page, metrics, admin API, health).
func RunEPP(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := config.Parse(args, stdout)
	if err != nil {
		return err
	}
	cfg.EPP = true
	return Serve(ctx, cfg, stdout, stderr)
}

// The gRPC health services of an Endpoint Picker (004-endpoint-picker-protocol, v1.0.0).
const (
	HealthLiveness  = "liveness"
	HealthReadiness = "readiness"
)

// eppListener is the Endpoint Picker's gRPC server and its health.
type eppListener struct {
	srv    *grpc.Server
	ln     net.Listener
	health *health.Server
	ready  func() (bool, string)
	log    *slog.Logger
}

// NewEPP builds the Endpoint Picker's gRPC server for g: ext_proc answered by g's routing,
// and the health services (liveness always serving; readiness and ExternalProcessor serving
// while the worker source has synced and the gateway is ready).
func (g *Gateway) NewEPP(cfg config.Config) (*grpc.Server, *health.Server) {
	es := &epp.Server{
		Picker:  g.Server.EndpointPicker(server.EPPOptions{Fallbacks: cfg.EPPFallbacks, ShedQueueDepth: cfg.EPPShedQueueDepth, ShedKVUsage: cfg.EPPShedKVUsage}),
		MaxBody: cfg.MaxPayloadSize, MaxHeaderBytes: h1.DefaultMaxHeaderBytes, Log: g.Log,
		MaxDuration: cfg.RequestTimeout + writeGrace,
		Observe: func(code string, d time.Duration) {
			if code == "" {
				g.Metrics.EPPDecisions.WithLabelValues("picked").Inc()
				g.Metrics.EPPDecisionSeconds.Observe(d.Seconds())
				return
			}
			g.Metrics.EPPDecisions.WithLabelValues(code).Inc()
		},
	}
	es.Reserve, es.Release = g.Server.BodyBudget()
	// A buffered body arrives in one message: it may be as large as a request body may be.
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(int(cfg.MaxPayloadSize) + 64<<10))
	extprocv3.RegisterExternalProcessorServer(srv, es)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	hs.SetServingStatus(HealthLiveness, healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	setReady(hs, false)
	return srv, hs
}

// writeGrace is how long past the request deadline an exchange may still relay its response.
const writeGrace = 2 * time.Second

// setReady sets the readiness and ExternalProcessor services.
func setReady(hs *health.Server, ok bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ok {
		st = healthpb.HealthCheckResponse_SERVING
	}
	hs.SetServingStatus(HealthReadiness, st)
	hs.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, st)
}

// EPPReady reports whether the Endpoint Picker can pick: the worker source synced (discovery
// listed its pods and found its pool) and the gateway ready (not draining, a ready worker of
// every model); else why not.
func (g *Gateway) EPPReady() (bool, string) {
	if d := g.discovery.d.Load(); d != nil && !d.Synced() {
		if p := d.PoolProblem(); p != "" {
			return false, p
		}
		return false, "service discovery has not listed the pods yet"
	}
	if g.Config.ServiceDiscovery || g.Config.InferencePool != "" {
		if g.discovery.d.Load() == nil {
			return false, "service discovery has not started"
		}
	}
	return g.Server.Ready()
}

// listenEPP opens the Endpoint Picker's listener.
func (g *Gateway) listenEPP(cfg config.Config) (*eppListener, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.GRPCPort)))
	if err != nil {
		return nil, fmt.Errorf("listen for the Endpoint Picker: %w", err)
	}
	srv, hs := g.NewEPP(cfg)
	if cfg.ClientAPIKey != "" || len(cfg.Tenants) > 0 || cfg.Admission.MaxConcurrentRequests > 0 {
		g.Log.Warn("epp: the Endpoint Picker checks no API key, tenant limit or admission slot (the HTTP listener's proxy still does): the gateway in front authenticates and limits")
	}
	return &eppListener{srv: srv, ln: ln, health: hs, ready: g.EPPReady, log: g.Log}, nil
}

// watch keeps the readiness services in step with ready until ctx ends; a change is logged.
func (e *eppListener) watch(ctx context.Context) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	was, wasWhy := false, ""
	for {
		ok, why := e.ready()
		setReady(e.health, ok)
		if ok != was || why != wasWhy {
			if ok {
				e.log.Info("epp: ready")
			} else {
				e.log.Info("epp: not ready", "why", why)
			}
			was, wasWhy = ok, why
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// stop ends the gRPC server: readiness off (the gateway stops asking), the streams of
// requests still answering given until deadline, then cut.
func (e *eppListener) stop(deadline time.Time) {
	e.health.Shutdown()
	done := make(chan struct{})
	go func() { e.srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Until(deadline)):
		e.srv.Stop()
		<-done
	}
}
