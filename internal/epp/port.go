package epp

import (
	"context"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/h1"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/routes"
)

// The gRPC health services of an Endpoint Picker (004-endpoint-picker-protocol, v1.0.0).
const (
	HealthLiveness  = "liveness"
	HealthReadiness = "readiness"
)

// WriteGrace is how long past the request deadline an exchange may still relay its response.
const WriteGrace = 2 * time.Second

// Port is what the picker's gRPC server is made of: the gateway's director, metrics and host,
// the body budget the HTTP listener's bodies share, and the configuration, whose EPP settings
// and request bounds it reads.
type Port struct {
	Director *director.Director
	Metrics  *metrics.Metrics
	Host     Host
	// BodyBudget hands out the process-wide body budget's take and give (nil: none).
	BodyBudget func() (take func(int64) bool, give func(int64))
	Log        *slog.Logger
	Config     config.Config
}

// NewGRPC builds the Endpoint Picker's gRPC server: ext_proc answered by the director's routing,
// and the health services (liveness always serving; readiness and ExternalProcessor not serving
// until SetReady says so).
func NewGRPC(p Port) (*grpc.Server, *health.Server) {
	cfg, m := p.Config, p.Metrics
	es := &Server{
		Picker:  NewPicker(p.Director, m, p.Host, Options{Fallbacks: cfg.EPPFallbacks, ShedQueueDepth: cfg.EPPShedQueueDepth, ShedKVUsage: cfg.EPPShedKVUsage}),
		MaxBody: cfg.MaxPayloadSize, MaxHeaderBytes: h1.DefaultMaxHeaderBytes, Log: p.Log,
		MaxDuration: cfg.RequestTimeout + WriteGrace, RequestPhase: cfg.BodyTimeout, MaxStreams: cfg.EPPMaxStreams,
		Cut: func(reason string) { m.EPPCut.WithLabelValues(reason).Inc() }, Streams: m.EPPStreams,
		Observe: func(code string, d time.Duration) {
			if code == "" {
				m.EPPDecisions.WithLabelValues("picked").Inc()
				m.EPPDecisionSeconds.Observe(d.Seconds())
				return
			}
			m.EPPDecisions.WithLabelValues(code).Inc()
		},
		Owned:   openai.OwnedIn,
		Guarded: guarded,
	}
	if p.BodyBudget != nil {
		es.Reserve, es.Release = share(p.BodyBudget, cfg.MaxBufferedBodyBytes)
	}
	msg, streams := MessageBound(cfg)
	if es.MaxStreams <= 0 || streams < es.MaxStreams {
		es.MaxStreams = streams
	}
	srv := grpc.NewServer(
		// gRPC holds a whole message before the picker sees it, at most this much per stream.
		grpc.MaxRecvMsgSize(msg),
		// A fixed window (no BDP growth): what a peer sends ahead of the message being read
		// stays within 64 KiB a stream, whatever the picker is waiting on.
		grpc.InitialWindowSize(streamWindow), grpc.InitialConnWindowSize(connWindow),
		grpc.MaxConcurrentStreams(uint32(cfg.EPPMaxStreamsPerConnection)),
		// A connection that does not complete its TLS and HTTP/2 handshakes within 5 s is closed
		// (gRPC's default is 120 s): silent sockets hold a place among the connections briefly.
		grpc.ConnectionTimeout(5*time.Second),
		// A data plane pings at most every 10 s; a connection without streams for 10 minutes is
		// closed, and one whose peer stopped answering pings is found within a minute.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: 10 * time.Minute, Time: 30 * time.Second, Timeout: 20 * time.Second}),
	)
	extprocv3.RegisterExternalProcessorServer(srv, es)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	hs.SetServingStatus(HealthLiveness, healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	SetReady(hs, false)
	return srv, hs
}

// guarded reports whether a request's body must be read for the fields Baton owns: every POST
// but one to a route Baton knows as no inference route. A path spelled otherwise than the route
// table's (escaped, doubled slashes, a trailing slash or parameters) is guarded: an engine's
// server may still route it to an inference handler.
func guarded(method, path string) bool {
	if method != http.MethodPost {
		return false
	}
	r := routes.Of(path)
	return r.Path == "" || r.Inference
}

// The picker's bounds on what gRPC holds of the messages it receives: the smallest message
// bound (the largest request headers, 64 KiB, and the chunks a data plane streams a body in,
// Envoy's 16 KiB, with room to spare), the headroom a body's message needs beyond the body
// (header fields, metadata), and the flow-control windows.
const (
	minMessage   = 128 << 10
	envelope     = 64 << 10
	streamWindow = 64 << 10
	connWindow   = 16 << 20
)

// MessageBound is the largest ext_proc message the picker's gRPC server takes, and how many
// exchanges it serves at once. gRPC reads a whole message before the picker sees any of it,
// so the messages being received are bounded where the budget cannot reach them: each stream
// gets its share of the picker's part of max_buffered_body_bytes (half of it, over
// epp_max_streams), at most a body of max_payload_size in one message, at least minMessage.
// Where minMessage rules, fewer exchanges are served at once (streams), so that the messages
// in flight never hold more than that part. A body larger than the bound comes in chunks
// (FULL_DUPLEX_STREAMED, as the protocol asks); a message past the bound (a BUFFERED body
// larger) ends its stream with RESOURCE_EXHAUSTED before any of it is read.
func MessageBound(cfg config.Config) (size, streams int) {
	part := cfg.MaxBufferedBodyBytes / 2
	n := int64(max(cfg.EPPMaxStreams, 1))
	size64 := min(max(part/n, minMessage), cfg.MaxPayloadSize+envelope)
	return int(size64), int(max(min(n, part/size64), 1))
}

// share is the body budget's part the picker may hold: at most half of total
// (max_buffered_body_bytes), so that bodies a data plane streams and abandons never leave the
// HTTP listener's requests without room.
func share(budget func() (func(int64) bool, func(int64)), total int64) (take func(int64) bool, give func(int64)) {
	t, gv := budget()
	var held atomic.Int64
	limit := total / 2
	take = func(n int64) bool {
		if held.Add(n) > limit {
			held.Add(-n)
			return false
		}
		if !t(n) {
			held.Add(-n)
			return false
		}
		return true
	}
	give = func(n int64) {
		held.Add(-n)
		gv(n)
	}
	return take, give
}

// SetReady sets the readiness and ExternalProcessor services.
func SetReady(hs *health.Server, ok bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ok {
		st = healthpb.HealthCheckResponse_SERVING
	}
	hs.SetServingStatus(HealthReadiness, st)
	hs.SetServingStatus(extprocv3.ExternalProcessor_ServiceDesc.ServiceName, st)
}

// WatchReady keeps hs's readiness services in step with ready until ctx ends; a change is
// logged.
func WatchReady(ctx context.Context, hs *health.Server, ready func() (bool, string), log *slog.Logger) {
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	was, wasWhy := false, ""
	for {
		ok, why := ready()
		SetReady(hs, ok)
		if ok != was || why != wasWhy {
			if ok {
				log.Info("epp: ready")
			} else {
				log.Info("epp: not ready", "why", why)
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
