package app

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/h1"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/routes"
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

// eppListener is the Endpoint Picker's gRPC server and its health, and the plaintext health
// server on a port of its own (nil: none).
type eppListener struct {
	srv      *grpc.Server
	ln       net.Listener
	health   *health.Server
	ready    func() (bool, string)
	log      *slog.Logger
	hsrv     *grpc.Server
	hln      net.Listener
	cert     *certificate // the gRPC port's certificate from files; nil: none, or made at startup
	certPath string
}

// NewEPP builds the Endpoint Picker's gRPC server for g: ext_proc answered by g's routing,
// and the health services (liveness always serving; readiness and ExternalProcessor serving
// while the worker source has synced and the gateway is ready).
func (g *Gateway) NewEPP(cfg config.Config) (*grpc.Server, *health.Server) {
	es := &epp.Server{
		Picker:  epp.NewPicker(g.Server.Director(), g.Metrics, g.Server, epp.Options{Fallbacks: cfg.EPPFallbacks, ShedQueueDepth: cfg.EPPShedQueueDepth, ShedKVUsage: cfg.EPPShedKVUsage}),
		MaxBody: cfg.MaxPayloadSize, MaxHeaderBytes: h1.DefaultMaxHeaderBytes, Log: g.Log,
		MaxDuration: cfg.RequestTimeout + writeGrace, RequestPhase: cfg.BodyTimeout, MaxStreams: cfg.EPPMaxStreams,
		Cut: func(reason string) { g.Metrics.EPPCut.WithLabelValues(reason).Inc() }, Streams: g.Metrics.EPPStreams,
		Observe: func(code string, d time.Duration) {
			if code == "" {
				g.Metrics.EPPDecisions.WithLabelValues("picked").Inc()
				g.Metrics.EPPDecisionSeconds.Observe(d.Seconds())
				return
			}
			g.Metrics.EPPDecisions.WithLabelValues(code).Inc()
		},
	}
	es.Reserve, es.Release = pickerShare(g.Server.BodyBudget, cfg.MaxBufferedBodyBytes)
	es.Owned = openai.OwnedIn
	es.Guarded = func(method, path string) bool { return method == http.MethodPost && routes.Of(path).Inference }
	srv := grpc.NewServer(
		// A buffered body arrives in one message: it may be as large as a request body may be.
		grpc.MaxRecvMsgSize(int(cfg.MaxPayloadSize)+64<<10),
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
	setReady(hs, false)
	return srv, hs
}

// pickerShare is the body budget's part the picker may hold: at most half of
// max_buffered_body_bytes, so that bodies a data plane streams and abandons never leave the
// HTTP listener's requests without room.
func pickerShare(budget func() (func(int64) bool, func(int64)), total int64) (take func(int64) bool, give func(int64)) {
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
	ln = &h1.LimitListener{Listener: ln, Max: cfg.EPPMaxConnections, OnRefuse: func() { g.Metrics.EPPCut.WithLabelValues("max_connections").Inc() }}
	el := &eppListener{ready: g.EPPReady, log: g.Log}
	if cfg.EPPSecureServing {
		tc, cert, err := eppTLS(cfg)
		if err != nil {
			ln.Close()
			return nil, err
		}
		el.cert, el.certPath = cert, cfg.EPPTLSCertPath
		ln = tls.NewListener(ln, tc)
		if cert == nil {
			g.Log.Info("epp: TLS on the gRPC port with a self-signed certificate made at startup (--epp-tls-cert-path gives one)")
		}
	} else {
		g.Log.Warn("epp: the gRPC port speaks plaintext (--epp-secure-serving=false): keep it to the gateway with a NetworkPolicy")
	}
	srv, hs := g.NewEPP(cfg)
	el.srv, el.ln, el.health = srv, ln, hs
	if cfg.GRPCHealthPort >= 0 {
		hln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.GRPCHealthPort)))
		if err != nil {
			ln.Close()
			return nil, fmt.Errorf("listen for the Endpoint Picker's health: %w", err)
		}
		el.hln, el.hsrv = hln, grpc.NewServer(grpc.MaxConcurrentStreams(16))
		healthpb.RegisterHealthServer(el.hsrv, hs)
	}
	if cfg.ClientKey() != "" || len(cfg.Tenants) > 0 || cfg.Admission.MaxConcurrentRequests > 0 {
		g.Log.Warn("epp: the Endpoint Picker checks no API key, tenant limit or admission slot (the HTTP listener's proxy still does): the gateway in front authenticates and limits")
	}
	return el, nil
}

// serve serves the gRPC port and the health port until they stop; the first error ends both.
func (e *eppListener) serve() <-chan error {
	errc := make(chan error, 2)
	go func() { errc <- e.srv.Serve(e.ln) }()
	if e.hsrv != nil {
		go func() { errc <- e.hsrv.Serve(e.hln) }()
	}
	return errc
}

// eppTLS is the gRPC port's TLS: the certificate files (re-read when they change: cert is
// non-nil) or a self-signed certificate made now; client certificates required when a CA is
// given.
func eppTLS(cfg config.Config) (*tls.Config, *certificate, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
	var cert *certificate
	if cfg.EPPTLSCertPath != "" {
		cert = &certificate{certPath: cfg.EPPTLSCertPath, keyPath: cfg.EPPTLSKeyPath}
		if err := cert.load(); err != nil {
			return nil, nil, fmt.Errorf("epp: %w", err)
		}
		tc.GetCertificate = func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return cert.current.Load(), nil }
	} else {
		c, err := selfSigned()
		if err != nil {
			return nil, nil, fmt.Errorf("epp: a self-signed certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{c}
	}
	if cfg.EPPClientCAPath != "" {
		pem, err := config.ReadFile(cfg.EPPClientCAPath, config.MaxSmallFile)
		if err != nil {
			return nil, nil, fmt.Errorf("epp: client CA: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, nil, fmt.Errorf("epp: client CA %s holds no PEM certificate", cfg.EPPClientCAPath)
		}
		tc.ClientCAs, tc.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return tc, cert, nil
}

// selfSigned makes a certificate for the gRPC port when none is given: ECDSA P-256, a year,
// for localhost and the host's name (the data plane does not verify it; mTLS needs real ones).
func selfSigned() (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		return tls.Certificate{}, err
	}
	names := []string{"localhost"}
	if h, err := os.Hostname(); err == nil && h != "" {
		names = append(names, h)
	}
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: "baton-epp"}, DNSNames: names,
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:   time.Now().Add(-time.Hour), NotAfter: time.Now().Add(365 * 24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// watchCert re-reads the gRPC port's certificate files when they change (checked every
// interval, applied once they hold still), until ctx ends; files that do not load keep the one
// served.
func (e *eppListener) watchCert(ctx context.Context, interval time.Duration) {
	if e.cert == nil {
		return
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	sums := steadySum{last: e.cert.sum()}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !sums.changed(e.cert.sum()) {
			continue
		}
		if err := e.cert.load(); err != nil {
			e.log.Error("epp: the gRPC port's certificate files changed but do not load; the one served stays", "err", err)
		} else {
			e.log.Info("epp: the gRPC port's certificate files changed: reloaded", "cert", e.certPath)
		}
	}
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
	if e.hsrv != nil {
		defer e.hsrv.Stop()
	}
	done := make(chan struct{})
	go func() { e.srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Until(deadline)):
		e.srv.Stop()
		<-done
	}
}
