package app

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"strconv"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/h1"
)

// RunEPP runs `baton epp` with args until ctx ends: Baton as a Gateway API Inference Extension
// Endpoint Picker, the ext_proc and gRPC health services on --grpc-port beside the usual HTTP
// listeners (status page, metrics, admin API, health).
func RunEPP(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg, err := config.Parse(args, stdout)
	if err != nil {
		return err
	}
	// The picker sees neither leg of a pair (the data plane's sidecar runs them): the advisor
	// cannot fit a prefill from it, and a prefill serving a request whole is the sidecar's to
	// do, which llm-d's does not.
	if cfg.PDLocalPrefillAuto {
		return errors.New("pd_local_prefill_auto is not for the Endpoint Picker: the advisor fits the prefill from its legs' times, which only the data plane's sidecar sees (pd_local_prefill_threshold is the picker's: a pick for a short prompt names no prefill)")
	}
	if cfg.PDPrefillServesWhole {
		return errors.New("pd_prefill_serves_whole is not for the Endpoint Picker: a pick names a decode pod, whose sidecar runs the pair; no sidecar serves a request on a prefill pod whole")
	}
	cfg.EPP = true
	return Serve(ctx, cfg, stdout, stderr)
}

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
	return epp.NewGRPC(epp.Port{Director: g.Server.Director(), Metrics: g.Metrics, Host: g.Server,
		BodyBudget: g.Server.BodyBudget, Log: g.Log, Config: cfg})
}

// EPPReady reports whether the Endpoint Picker can pick: the worker source synced (discovery
// listed its pods and found its pool) and the gateway ready (not draining, and any model can be
// served); else why not.
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

// watch keeps the readiness services in step with the gateway until ctx ends.
func (e *eppListener) watch(ctx context.Context) { epp.WatchReady(ctx, e.health, e.ready, e.log) }

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
