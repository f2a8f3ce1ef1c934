package bench

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// hotpath: scenario 10, the hot path's goals in one run — CPU per request on pass-through
// (against nginx) and on vLLM NIXL PD with 16 clients, for this Baton and, with --baseline, an
// earlier build measured in the same run.
func (r *runner) hotpath(ctx context.Context) error {
	fmt.Fprintln(r.out, "## 10. Hot path: CPU per request")
	fmt.Fprintln(r.out)
	n := r.n(20000, 300)
	fmt.Fprintf(r.out, "Closed loop, %d non-streamed requests per row (512-byte prompt, 16 tokens); CPU is the proxy process's user+system time per request. Pass-through: 64 clients, one engine. PD: vLLM NIXL, 16 clients, one prefill and one decode engine.\n\n", n)
	fmt.Fprintln(r.out, "| row | proxy | req/s | CPU µs / request | vs nginx (PD: vs pd-sidecar) | vs baseline |")
	fmt.Fprintln(r.out, "|---|---|---:|---:|---:|---:|")
	var binaries []struct{ name, path string }
	if r.o.Baseline != "" { // first, so that Baton's rows can say how they compare
		binaries = append(binaries, struct{ name, path string }{"baseline", r.o.Baseline})
	}
	binaries = append(binaries, struct{ name, path string }{"Baton", r.o.Binary})
	w := workload{promptBytes: 512, maxTokens: 16}
	perReq := func(m measured) float64 { return m.cpu / float64(m.s.N) * 1e6 }

	// Pass-through.
	e, err := engine(sim.Config{Engine: sim.EngineVLLM})
	if err != nil {
		return err
	}
	defer e.Close()
	var nginxCPU float64
	if ng, err := startNginx(1, e.Addr()); err != nil {
		return err
	} else if ng != nil {
		m := r.run(ctx, "hotpath nginx", completion(r.client, ng.URL, w), 64, n, ng)
		ng.stop()
		nginxCPU = perReq(m)
		fmt.Fprintf(r.out, "| pass-through | nginx | %.0f | %s | 1.00× | |\n", m.s.Throughput(), r.cpuCell(m, "%.1f", nginxCPU))
	}
	results := map[string]float64{}
	for _, bin := range binaries {
		b, err := startBaton(bin.path, 1, "--worker-urls", e.URL(), "--access-log=false")
		if err != nil {
			b, err = startBaton(bin.path, 1, "--worker-urls", e.URL()) // a build from before the flag
			if err != nil {
				return err
			}
		}
		m := r.run(ctx, "hotpath "+bin.name, completion(r.client, b.URL, w), 64, n, b)
		b.stop()
		results["pt "+bin.name] = perReq(m)
		fmt.Fprintf(r.out, "| pass-through | %s | %.0f | %s | %s | %s |\n", bin.name, m.s.Throughput(), r.cpuCell(m, "%.1f", perReq(m)), ratioF(perReq(m), nginxCPU), ratioF(perReq(m), results["pt baseline"]))
	}
	// PD vLLM NIXL.
	p, err := engine(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	if err != nil {
		return err
	}
	defer p.Close()
	d, err := engine(sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
	if err != nil {
		return err
	}
	defer d.Close()
	var sidecarCPU, sidecarRate float64
	if r.o.PDSidecar != "" { // first, so that Baton's rows can say how they compare
		sc, err := startPDSidecar(r.o.PDSidecar, 1, p.Addr(), d)
		if err != nil {
			return err
		}
		hdr := http.Header{"X-Prefiller-Host-Port": {p.Addr()}}
		m := r.run(ctx, "hotpath PD pd-sidecar", completionWith(r.client, sc.URL, w, hdr), 16, n, sc)
		sc.stop()
		sidecarCPU, sidecarRate = perReq(m), m.s.Throughput()
		fmt.Fprintf(r.out, "| PD vLLM NIXL | llm-d pd-sidecar | %.0f | %s | 1.00× (pd-sidecar) | |\n", sidecarRate, r.cpuCell(m, "%.1f", sidecarCPU))
	}
	var pdRates []string
	for _, bin := range binaries {
		args := []string{"--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", p.URL(), "--decode", d.URL()}
		b, err := startBaton(bin.path, 1, append(args, "--access-log=false")...)
		if err != nil {
			if b, err = startBaton(bin.path, 1, args...); err != nil {
				return err
			}
		}
		time.Sleep(200 * time.Millisecond)
		m := r.run(ctx, "hotpath PD "+bin.name, completion(r.client, b.URL, w), 16, n, b)
		b.stop()
		results["pd "+bin.name] = perReq(m)
		fmt.Fprintf(r.out, "| PD vLLM NIXL | %s | %.0f | %s | %s | %s |\n", bin.name, m.s.Throughput(), r.cpuCell(m, "%.1f", perReq(m)), ratioF(perReq(m), sidecarCPU), ratioF(perReq(m), results["pd baseline"]))
		if sidecarRate > 0 {
			pdRates = append(pdRates, fmt.Sprintf("%s %s", bin.name, ratioF(m.s.Throughput(), sidecarRate)))
		}
	}
	fmt.Fprintln(r.out)
	if len(pdRates) > 0 {
		fmt.Fprintf(r.out, "PD throughput against llm-d's pd-sidecar (the same engines, the same 16 clients, the sidecar pinned to Baton's core): %s.\n\n", strings.Join(pdRates, ", "))
	}
	r.cpuNote()
	return nil
}

// ratioF is a/b as "x.xx×", or empty without b.
func ratioF(a, b float64) string {
	if b == 0 {
		return ""
	}
	return fmt.Sprintf("%.2f×", a/b)
}

// startPDSidecar starts llm-d's pd-sidecar (a binary built from llm-d's repository; the README's
// benchmark section says how) on cpu beside the decode engine d, as it runs on a decode pod: it
// takes a request naming its prefill in x-prefiller-host-port, sends the one-token prefill there
// and the decode to d with the prefill's kv_transfer_params. It returns once a request through it
// has been answered 200.
func startPDSidecar(binary string, cpu int, prefill string, d *sim.Engine) (*proc, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	_, dport, err := net.SplitHostPort(d.Addr())
	if err != nil {
		return nil, err
	}
	argv := pinned(cpu, binary, "--port", strconv.Itoa(port), "--vllm-port", dport, "--kv-connector", "nixlv2", "--secure-proxy=false", "--zap-log-level", "error")
	cmd := exec.Command(argv[0], argv[1:]...)
	sc := &proc{cmd: cmd, logs: &procLog{}, URL: fmt.Sprintf("http://127.0.0.1:%d", port)}
	cmd.Stdout, cmd.Stderr = sc.logs, sc.logs
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("pd-sidecar: %w", err)
	}
	w := workload{promptBytes: 64, maxTokens: 2}
	try := completionWith(http.DefaultClient, sc.URL, w, http.Header{"X-Prefiller-Host-Port": {prefill}})
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		res := try(ctx, 0)
		cancel()
		if res.Err == nil {
			return sc, nil
		}
		if time.Now().After(deadline) {
			sc.stop()
			return nil, fmt.Errorf("pd-sidecar never answered a PD request (%v): %s", res.Err, sc.logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
