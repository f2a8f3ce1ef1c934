// Package app wires Baton together and runs it: configuration, registry, registration,
// policies, servers, and the drain on shutdown.
package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/server"
	"github.com/baton-llm/baton/internal/worker"
)

// Run runs the baton command with args (without the program name) until ctx ends. It returns
// nil after a clean shutdown and config.ErrHelp after printing help.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cmd := "serve"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "serve":
		cfg, err := config.Parse(args, stdout)
		if err != nil {
			return err
		}
		return Serve(ctx, cfg, stdout, stderr)
	case "sim":
		return runSim(ctx, args, stdout)
	case "demo":
		return runDemo(ctx, args, stdout, stderr)
	default:
		return fmt.Errorf("unknown command %q (want serve, sim or demo)", cmd)
	}
}

// NewLogger returns the slog logger the configuration asks for, writing to w.
func NewLogger(cfg config.Config, w io.Writer) *slog.Logger {
	var level slog.Level
	_ = level.UnmarshalText([]byte(cfg.LogLevel))
	opts := &slog.HandlerOptions{Level: level}
	if cfg.LogJSON {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// Gateway is a wired, not yet listening Baton: what Serve runs, and what tests drive in-process.
type Gateway struct {
	Config    config.Config
	Registry  *worker.Registry
	Metrics   *metrics.Metrics
	Server    *server.Server
	Parallel  *pd.Parallel
	Registrar *worker.Registrar
	Log       *slog.Logger
}

// New wires a gateway from cfg. It does no I/O.
func New(cfg config.Config, log *slog.Logger) (*Gateway, error) {
	var ws []*worker.Worker
	for _, c := range cfg.AllWorkers() {
		ws = append(ws, worker.New(c))
	}
	reg := worker.NewRegistry(ws...)
	m := metrics.New(reg)
	policies := map[string]policy.Policy{}
	for _, role := range []string{config.RoleRegular, config.RolePrefill, config.RoleDecode} {
		p, err := policy.New(cfg.PolicyFor(role))
		if err != nil {
			return nil, err
		}
		policies[role] = p
	}
	transport := proxy.NewTransport()
	px := &proxy.Proxy{
		Transport: transport,
		Timeout:   time.Duration(cfg.RequestTimeoutSecs) * time.Second,
		Metrics:   m,
		Log:       log,
	}
	parallel := &pd.Parallel{Proxy: px, Metrics: m, Log: log}
	sequential := &pd.Sequential{Proxy: px, Metrics: m, Log: log, DefaultConnector: cfg.KVConnector,
		RequireHandoff: cfg.PDRequireHandoff, MooncakeConcurrent: cfg.PDMooncakeDispatch == "concurrent", Concurrent: parallel}
	return &Gateway{
		Config:   cfg,
		Registry: reg,
		Metrics:  m,
		Parallel: parallel,
		Server:   server.New(cfg, reg, policies, px, parallel, sequential, m, log),
		Registrar: &worker.Registrar{
			Registry:    reg,
			Client:      &http.Client{Transport: transport},
			Log:         log,
			MaxInterval: time.Duration(cfg.DetectIntervalSecs) * time.Second,
			OnRegistered: func(w *worker.Worker) {
				logConnector(log, cfg, w)
			},
		},
		Log: log,
	}, nil
}

// Serve runs the gateway until ctx ends, then drains: readiness turns 503, in-flight requests
// and streams finish (up to the grace period), and Serve returns nil.
func Serve(ctx context.Context, cfg config.Config, stdout, stderr io.Writer) error {
	log := NewLogger(cfg, stderr)
	g, err := New(cfg, log)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.Port)))
	if err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	api := &http.Server{
		Handler:           g.Server.Handler(),
		ReadHeaderTimeout: 30 * time.Second,
		IdleTimeout:       120 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	var msrv *http.Server
	var mln net.Listener
	if cfg.MetricsPort >= 0 {
		mln, err = net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(cfg.MetricsPort)))
		if err != nil {
			ln.Close()
			return fmt.Errorf("listen for metrics: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", g.Metrics.Handler())
		msrv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	}

	bg, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()
	g.Registrar.Start(bg)
	errc := make(chan error, 2)
	go func() { errc <- api.Serve(ln) }()
	if msrv != nil {
		go func() { errc <- msrv.Serve(mln) }()
		fmt.Fprintf(stdout, "baton serving on http://%s (metrics on http://%s/metrics)\n", ln.Addr(), mln.Addr())
	} else {
		fmt.Fprintf(stdout, "baton serving on http://%s\n", ln.Addr())
	}
	log.Info("baton started", "addr", ln.Addr().String(), "workers", len(g.Registry.Snapshot().Workers), "policy", cfg.Policy)

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	g.drain(api, time.Duration(cfg.ShutdownGracePeriodSecs)*time.Second)
	if msrv != nil {
		_ = msrv.Close()
	}
	stopBG()
	g.Registrar.Wait()
	g.Parallel.Wait()
	if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
		return fmt.Errorf("serve: %w", serveErr)
	}
	log.Info("baton stopped")
	return nil
}

// drain turns readiness to 503 and keeps serving until in-flight requests are done or grace
// passes, then closes the listener and waits for the last handlers.
func (g *Gateway) drain(api *http.Server, grace time.Duration) {
	g.Server.SetDraining()
	g.Log.Info("draining", "in_flight", g.Server.InFlight(), "grace", grace)
	deadline := time.Now().Add(grace)
	for g.Server.InFlight() > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline.Add(time.Second))
	defer cancel()
	if err := api.Shutdown(ctx); err != nil {
		g.Log.Warn("drain grace period passed; closing open connections", "in_flight", g.Server.InFlight())
		_ = api.Close()
	}
}

// logConnector makes a vLLM prefill worker's effective KV connector visible at registration,
// and warns when none is configured: its decodes would recompute unless the engine happens to
// return kv_transfer_params.
func logConnector(log *slog.Logger, cfg config.Config, w *worker.Worker) {
	if w.Role != config.RolePrefill || w.Runtime() != config.RuntimeVLLM {
		return
	}
	c := pd.ConnectorFor(w, cfg.KVConnector)
	if c.Name == "" {
		log.Warn("vLLM prefill worker has no KV connector configured: passthrough mode, decodes recompute unless the engine returns kv_transfer_params; set kv_connector (NixlConnector or MooncakeConnector) on the worker or --kv-connector",
			"worker", w.URL)
		return
	}
	log.Info("vLLM prefill worker KV connector", "worker", w.URL, "mode", c.Mode, "detail", c.String())
}
