package bench

import (
	"context"
	"fmt"
	"math"
	"net"
	"net/http"
	"os/exec"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/baton-llm/baton/internal/sim"
)

// hotpath: scenario 10, the hot path's goals in one run — CPU per request on pass-through
// (against nginx) and on vLLM NIXL PD with 16 clients (against llm-d's pd-sidecar with
// --pd-sidecar), for this Baton and, with --baseline, an earlier build measured in the same run.
// Every proxy of a path runs at once, each its own process on the same core, and the path's
// requests go to them in rounds, each proxy a share in turn, so that a change in the machine's
// speed during the run falls on all of them alike.
func (r *runner) hotpath(ctx context.Context) error {
	// The load generator and the simulators share CPU 0, where at the PD path's rates they are the
	// bottleneck: the fewer of its cycles the harness's own collector takes, the nearer the
	// throughput rows come to what each proxy's core can do. The proxies are processes of their
	// own, with their own collectors.
	defer debug.SetGCPercent(debug.SetGCPercent(400))
	fmt.Fprintln(r.out, "## 10. Hot path: CPU per request")
	fmt.Fprintln(r.out)
	// Twenty rounds of 1,000 requests, not four of 5,000: a change in the machine's speed that
	// lasts a second or two then falls on every proxy's rounds, not on one proxy's share. Two
	// builds of one request path measured 0.97 – 1.03× of each other in six runs so, against
	// 0.93 – 1.08× in four rounds.
	n, rounds := r.n(20000, 300), r.n(20, 1)
	fmt.Fprintf(r.out, "Closed loop, %d non-streamed requests per row (512-byte prompt, 16 tokens) in %d rounds, each proxy in turn; CPU is the proxy process's user+system time per request. The load generator writes each request and reads its answer with net/http's wire code on kept-alive connections of its own, without net/http's Transport and its goroutines per connection. The engines answer without the simulator's own X-Sim headers, which no engine sends. Pass-through: 64 clients, one engine. PD: vLLM NIXL, 16 clients, one prefill and one decode engine, the decode taking the prefill's KV by a call instead of a pull over the side channel (engine-to-engine traffic, which never crosses the proxy; it kept CPU 0 the bound of the PD rows). The last two columns say what bounds a row's rate: its proxy's core busy (the proxy's CPU over the row's time) and the harness's own CPU per request (load generator and simulators, on CPU 0); where the harness's CPU per request times req/s nears one second per second, CPU 0 is the bound, not the proxy.\n\n", n, rounds)
	fmt.Fprintln(r.out, "| row | proxy | req/s | CPU µs / request | vs nginx (PD: vs pd-sidecar) | vs baseline | proxy's core busy | harness CPU µs / request |")
	fmt.Fprintln(r.out, "|---|---|---:|---:|---:|---:|---:|---:|")
	var binaries []struct{ name, path string }
	if r.o.Baseline != "" { // first, so that Baton's rows can say how they compare
		binaries = append(binaries, struct{ name, path string }{"baseline", r.o.Baseline})
	}
	binaries = append(binaries, struct{ name, path string }{"Baton", r.o.Binary})
	w := workload{promptBytes: 512, maxTokens: 16}
	// The load generator writes and reads on its connections with net/http's wire code, without
	// its Transport's goroutines (wireTransport): it shares CPU 0 with the simulated engines.
	wt := newWireTransport()
	defer wt.CloseIdleConnections()
	client := &http.Client{Transport: wt}

	// Pass-through.
	e, err := engine(sim.Config{Engine: sim.EngineVLLM, EngineHeadersOnly: true})
	if err != nil {
		return err
	}
	defer e.Close()
	var pt []hotTarget
	defer func() { stopTargets(pt) }()
	if ng, err := startNginx(1, e.Addr()); err != nil {
		return err
	} else if ng != nil {
		pt = append(pt, hotTarget{name: "nginx", p: ng, req: completion(client, ng.URL, w)})
	}
	for _, bin := range binaries {
		b, err := startBaton(bin.path, 1, "--worker-urls", e.URL(), "--access-log=false")
		if err != nil {
			b, err = startBaton(bin.path, 1, "--worker-urls", e.URL()) // a build from before the flag
			if err != nil {
				return err
			}
		}
		pt = append(pt, hotTarget{name: bin.name, p: b, req: completion(client, b.URL, w)})
	}
	ms := r.interleaved(ctx, "hotpath", pt, 64, n, rounds)
	stopTargets(pt)
	pt = nil
	r.hotRows("pass-through", ms, "nginx")
	spread := []string{roundSpread(ms, "nginx")}
	// PD vLLM NIXL.
	p, err := engine(sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, EngineHeadersOnly: true})
	if err != nil {
		return err
	}
	defer p.Close()
	d, err := engine(sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, SameProcessKV: true, EngineHeadersOnly: true})
	if err != nil {
		return err
	}
	defer d.Close()
	var pd []hotTarget
	defer func() { stopTargets(pd) }()
	if r.o.PDSidecar != "" {
		sc, err := startPDSidecar(r.o.PDSidecar, 1, p.Addr(), d)
		if err != nil {
			return err
		}
		hdr := http.Header{"X-Prefiller-Host-Port": {p.Addr()}}
		pd = append(pd, hotTarget{name: "llm-d pd-sidecar", p: sc, req: completionWith(client, sc.URL, w, hdr)})
	}
	for _, bin := range binaries {
		args := []string{"--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", p.URL(), "--decode", d.URL()}
		b, err := startBaton(bin.path, 1, append(args, "--access-log=false")...)
		if err != nil {
			if b, err = startBaton(bin.path, 1, args...); err != nil {
				return err
			}
		}
		pd = append(pd, hotTarget{name: bin.name, p: b, req: completion(client, b.URL, w)})
	}
	time.Sleep(200 * time.Millisecond)
	ms = r.interleaved(ctx, "hotpath PD", pd, 16, n, rounds)
	rates := r.hotRows("PD vLLM NIXL", ms, "llm-d pd-sidecar")
	fmt.Fprintln(r.out)
	if len(rates) > 0 {
		fmt.Fprintf(r.out, "PD throughput against llm-d's pd-sidecar (the same engines, the same 16 clients, the sidecar pinned to Baton's core): %s.\n\n", strings.Join(rates, ", "))
	}
	for _, line := range append(spread, roundSpread(ms, "llm-d pd-sidecar")) {
		if line != "" {
			fmt.Fprintf(r.out, "%s\n\n", line)
		}
	}
	r.cpuNote()
	return nil
}

// hotRows writes a path's rows: each proxy's throughput and CPU per request, against ref's (the
// target named so, when measured) and against the baseline build's; it returns the others'
// throughput against ref's.
func (r *runner) hotRows(path string, ms []measured, ref string) (rates []string) {
	perReq := func(m measured) float64 { return m.cpu / float64(m.s.N) * 1e6 }
	var refM, baseM measured
	for _, m := range ms {
		switch m.name {
		case ref:
			refM = m
		case "baseline":
			baseM = m
		}
	}
	for _, m := range ms {
		vs := ""
		if refM.s.N > 0 {
			vs = ratioF(perReq(m), perReq(refM))
			if m.name != ref {
				rates = append(rates, fmt.Sprintf("%s %s", m.name, ratioF(m.s.Throughput(), refM.s.Throughput())))
			}
		}
		vsBase := ""
		if baseM.s.N > 0 && m.name != ref {
			vsBase = ratioF(perReq(m), perReq(baseM))
		}
		busy := fmt.Sprintf("%.0f %%", 100*m.cpu/m.s.Elapsed.Seconds())
		harness := fmt.Sprintf("%.1f", m.harness/float64(m.s.N)*1e6)
		fmt.Fprintf(r.out, "| %s | %s | %.0f | %s | %s | %s | %s | %s |\n", path, m.name, m.s.Throughput(), r.cpuCell(m, "%.1f", perReq(m)), vs, vsBase, busy, harness)
	}
	return rates
}

// hotTarget is a proxy under the hotpath scenario's load.
type hotTarget struct {
	name string
	p    *proc
	req  Request
}

func stopTargets(ts []hotTarget) {
	for _, t := range ts {
		t.p.stop()
	}
}

// interleaved sends n requests to each target at concurrency c, in rounds of n/rounds, the
// targets in turn within each round, and returns each target's requests and CPU summed over the
// rounds, in the targets' order, with the harness's own CPU (load generator and simulators)
// while each was measured.
func (r *runner) interleaved(ctx context.Context, label string, ts []hotTarget, c, n, rounds int) []measured {
	ms := make([]measured, len(ts))
	for i, t := range ts {
		ms[i].name = t.name
	}
	for range rounds {
		for i, t := range ts {
			before := selfCPUSeconds()
			m := r.run(ctx, label+" "+t.name, t.req, c, n/rounds, t.p)
			ms[i].harness += selfCPUSeconds() - before
			s := &ms[i].s
			s.N, s.Errors, s.Elapsed = s.N+m.s.N, s.Errors+m.s.Errors, s.Elapsed+m.s.Elapsed
			ms[i].cpu += m.cpu
			ms[i].rounds = append(ms[i].rounds, m)
		}
	}
	return ms
}

// roundSpread says, for each target but ref, the least and most of its CPU per request and of
// its throughput against ref's in the same round, where there was more than one round: how far
// one run's ratio moves while the machine's speed does.
func roundSpread(ms []measured, ref string) string {
	var refM measured
	for _, m := range ms {
		if m.name == ref {
			refM = m
		}
	}
	if len(refM.rounds) < 2 {
		return ""
	}
	var parts []string
	for _, m := range ms {
		if m.name == ref || len(m.rounds) != len(refM.rounds) {
			continue
		}
		cpuLo, cpuHi, rateLo, rateHi := math.Inf(1), math.Inf(-1), math.Inf(1), math.Inf(-1)
		for i, a := range m.rounds {
			b := refM.rounds[i]
			if a.s.N == 0 || b.s.N == 0 || b.cpu == 0 || b.s.Throughput() == 0 {
				return ""
			}
			c := a.cpu / float64(a.s.N) / (b.cpu / float64(b.s.N))
			t := a.s.Throughput() / b.s.Throughput()
			cpuLo, cpuHi = min(cpuLo, c), max(cpuHi, c)
			rateLo, rateHi = min(rateLo, t), max(rateHi, t)
		}
		parts = append(parts, fmt.Sprintf("%s CPU %.2f – %.2f×, throughput %.2f – %.2f×", m.name, cpuLo, cpuHi, rateLo, rateHi))
	}
	if len(parts) == 0 {
		return ""
	}
	return fmt.Sprintf("Round by round against %s (each round's share against %s's in the same round; a round's CPU is read in 10 ms ticks): %s.", ref, ref, strings.Join(parts, "; "))
}

// ratioF is a/b as "x.xx×", or empty without b.
func ratioF(a, b float64) string {
	if b == 0 {
		return ""
	}
	return fmt.Sprintf("%.2f×", a/b)
}

// startPDSidecar starts llm-d's pd-sidecar (a binary built from llm-d's repository;
// docs/BENCHMARKS.md says how) on cpu beside the decode engine d, as it runs on a decode pod: it
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
