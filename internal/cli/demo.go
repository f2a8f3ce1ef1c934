package cli

import (
	"context"
	"fmt"
	"io"

	"github.com/baton-llm/baton/internal/app"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
)

// demoPair is one simulated prefill/decode pair of the demo, serving its own model.
type demoPair struct {
	model   string
	engine  string
	connect string // vLLM KV connector
	what    string
}

var demoPairs = []demoPair{
	{model: "demo-nixl", engine: sim.EngineVLLM, connect: sim.ConnectorNixl, what: "vLLM + NixlConnector: prefill first, its kv_transfer_params relayed to the decode"},
	{model: "demo-mooncake", engine: sim.EngineVLLM, connect: sim.ConnectorMooncake, what: "vLLM + MooncakeConnector: Baton mints transfer_id, both legs at once"},
	{model: "demo-sglang", engine: sim.EngineSGLang, what: "SGLang prefill + decode, parallel dispatch, bootstrap rendezvous"},
}

// connectorNames are the vLLM names of the simulator's connectors.
var connectorNames = map[string]string{sim.ConnectorNixl: "NixlConnector", sim.ConnectorMooncake: "MooncakeConnector"}

// runDemo starts simulated engines and a PD gateway in front of them on 127.0.0.1, prints
// what runs and what to try, and serves until ctx ends.
func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("baton demo", stdout)
	port := fs.Int("port", 30000, "gateway port (0 picks a free one)")
	metricsPort := fs.Int("metrics-port", 29000, "gateway metrics port (0 picks a free one)")
	logLevel := fs.String("log-level", "warn", "gateway log level")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("demo: unexpected argument %q", fs.Arg(0))
	}
	cfg := config.Default()
	cfg.Host, cfg.Port, cfg.MetricsPort, cfg.LogLevel = "127.0.0.1", *port, *metricsPort, *logLevel
	cfg.PDDisaggregation = true
	cfg.ForwardSimFaults = true // try: -H 'X-Sim-Fault: status=503' (every leg gets it)
	fmt.Fprintln(stdout, "Baton demo: simulated engines (deterministic fake model, no GPU) behind one PD gateway.")
	for _, dp := range demoPairs {
		pe, err := sim.Start(sim.Config{Engine: dp.engine, Role: sim.RolePrefill, KVConnector: dp.connect, Model: dp.model, EngineID: dp.model + "-prefill"})
		if err != nil {
			return err
		}
		defer pe.Close()
		de, err := sim.Start(sim.Config{Engine: dp.engine, Role: sim.RoleDecode, KVConnector: dp.connect, Model: dp.model})
		if err != nil {
			return err
		}
		defer de.Close()
		pw := config.Worker{URL: pe.URL(), Role: config.RolePrefill, KVConnector: connectorNames[dp.connect]}
		if dp.connect == sim.ConnectorMooncake {
			pw.KVEngineID = pe.EngineIDs()[0]
		}
		if bp := pe.BootstrapPort(); bp != 0 {
			pw.BootstrapPort = &bp
		}
		cfg.Workers = append(cfg.Workers, pw, config.Worker{URL: de.URL(), Role: config.RoleDecode})
		fmt.Fprintf(stdout, "  model %-14s %s\n    prefill %s   decode %s\n", dp.model, dp.what, pe.URL(), de.URL())
	}
	gw := fmt.Sprintf("http://127.0.0.1:%d", *port)
	if *port == 0 {
		gw = "http://127.0.0.1:<port printed below>"
	}
	m := demoPairs[0].model
	fmt.Fprintf(stdout, `
Try (every model above works the same way; /generate is SGLang's, use demo-sglang there):
  curl -si %[1]s/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"%[2]s","messages":[{"role":"user","content":"hello baton"}],"max_tokens":8}'
  curl -sN %[1]s/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"model":"%[2]s","messages":[{"role":"user","content":"stream please"}],"stream":true,"stream_options":{"include_usage":true}}'
  curl -s %[1]s/generate -H 'Content-Type: application/json' \
    -d '{"model":"demo-sglang","text":"once upon a time","sampling_params":{"max_new_tokens":8},"return_logprob":true}'
  curl -s %[1]s/workers
  curl -s localhost:%[3]d/metrics | grep ^baton_pd
The live status page (workers, pairs and their handoffs, rates, TTFT, errors): http://localhost:%[3]d/
Response headers name the pair (X-Baton-Prefill-Worker, X-Baton-Decode-Worker), the KV handoff
(X-Baton-Kv-Handoff: nixl, mooncake, or none-* when the decode recomputes) and where the decode's
KV came from (X-Sim-Kv-Source: remote). Ctrl-C stops the demo.

`, gw, m, *metricsPort)
	return app.Serve(ctx, cfg, stdout, stderr)
}
