package app

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

// runDemo starts simulated engines and a gateway in front of them on 127.0.0.1, prints what
// runs and what to try, and serves until ctx ends.
func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("baton demo", flag.ContinueOnError)
	fs.SetOutput(stdout)
	port := fs.Int("port", 30000, "gateway port (0 picks a free one)")
	metricsPort := fs.Int("metrics-port", 29000, "gateway metrics port (0 picks a free one)")
	logLevel := fs.String("log-level", "warn", "gateway log level")
	if err := fs.Parse(args); err != nil {
		return err
	}
	engines := []sim.Config{
		{Engine: sim.EngineVLLM, Role: sim.RoleBoth, Model: demoModel},
		{Engine: sim.EngineVLLM, Role: sim.RoleBoth, Model: demoModel},
		{Engine: sim.EngineSGLang, Role: sim.RoleBoth, Model: demoModel},
	}
	cfg := config.Default()
	cfg.Host, cfg.Port, cfg.MetricsPort, cfg.LogLevel = "127.0.0.1", *port, *metricsPort, *logLevel
	fmt.Fprintln(stdout, "Baton demo: simulated engines (deterministic fake model, no GPU) behind one gateway.")
	for _, ec := range engines {
		e, err := sim.Start(ec)
		if err != nil {
			return err
		}
		defer e.Close()
		cfg.WorkerURLs = append(cfg.WorkerURLs, e.URL())
		fmt.Fprintf(stdout, "  engine  %-6s %-7s %s\n", ec.Engine, ec.Role, e.URL())
	}
	gw := fmt.Sprintf("http://127.0.0.1:%d", *port)
	if *port == 0 {
		gw = "http://127.0.0.1:<port printed below>"
	}
	fmt.Fprintf(stdout, `
Try:
  curl -s %[1]s/v1/models
  curl -s %[1]s/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"%[2]s","messages":[{"role":"user","content":"hello baton"}],"max_tokens":8}'
  curl -sN %[1]s/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"%[2]s","messages":[{"role":"user","content":"stream please"}],"stream":true,"stream_options":{"include_usage":true}}'
  curl -s %[1]s/v1/completions -H 'Content-Type: application/json' -d '{"model":"%[2]s","prompt":"once upon a time"}'
  curl -s localhost:%[3]d/metrics | grep ^baton_
Every response names its engine in the X-Baton-Worker header (curl -i). Ctrl-C stops the demo.

`, gw, demoModel, *metricsPort)
	return Serve(ctx, cfg, stdout, stderr)
}

const demoModel = "baton-demo"
