package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime/pprof"
	"strings"

	"github.com/baton-llm/baton/internal/bench"
)

// pinnedEnv marks a bench process already pinned to its core.
const pinnedEnv = "BATON_BENCH_PINNED"

// runBench runs the benchmark harness. On a machine with more than one core it runs itself on
// CPU 0 and Baton on CPU 1, so that Baton's cost is measured on a core of its own.
func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("baton bench", stdout)
	quick := fs.Bool("quick", false, "small runs: checks the harness works (seconds), not for publishing")
	scenarios := fs.String("scenarios", "", "comma-separated scenarios to run (latency,throughput,streaming,memory,bodysize,workers,hardening,routing,replicas,hotpath,tenants,fairness,lora,epp; soak only when named); default all")
	out := fs.String("out", "", "also write the report to this file")
	binary := fs.String("binary", "", "the baton binary to measure (default: this one)")
	baseline := fs.String("baseline", "", "an earlier baton binary to measure beside it in the hotpath scenario")
	pdSidecar := fs.String("pd-sidecar", "", "llm-d's pd-sidecar binary, to measure beside Baton's PD path in the hotpath scenario (docs/BENCHMARKS.md says how to build it)")
	streams := fs.Int("streams", 0, "open streams in the memory scenario (default 1500; Baton holds two file descriptors per stream)")
	duration := fs.Duration("duration", 0, "how long the soak scenario runs (default 30m; 3m with --quick)")
	plot := fs.String("plot", "", "a PNG file: the soak scenario draws its fault timeline into it, pd-sizing its goodput per split")
	mixes := fs.String("mixes", "", "the pd-sizing and pd-advice workloads, comma-separated: chat, rag (default both)")
	cpuProfile := fs.String("cpu-profile", "", "write the harness's own CPU profile (its load generator and simulators, not the proxies measured) to this file, for go tool pprof")
	batonFlags := fs.String("baton-flags", "", "more flags for the Batons the soak scenario starts, space-separated (e.g. \"--http-server net\")")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("bench: unexpected argument %q", fs.Arg(0))
	}
	var names []string
	if *scenarios != "" {
		names = strings.Split(*scenarios, ",")
	}
	if err := bench.CheckScenarios(names); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	var mixList []string
	for m := range strings.SplitSeq(*mixes, ",") {
		switch m {
		case "":
		case "chat", "rag":
			mixList = append(mixList, m)
		default:
			return fmt.Errorf("bench: --mixes %q: want chat, rag", m)
		}
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	if *binary == "" {
		*binary = self
	}
	if os.Getenv(pinnedEnv) == "" {
		if taskset, err := exec.LookPath("taskset"); err == nil {
			cmd := exec.CommandContext(ctx, taskset, append([]string{"-c", "0", self, "bench", "--binary", *binary, "--baseline", *baseline}, args...)...)
			cmd.Env = append(os.Environ(), pinnedEnv+"=1")
			cmd.Stdout, cmd.Stderr = stdout, stderr
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("bench: %w", err)
			}
			return nil
		}
	}
	w := stdout
	if *out != "" {
		f, err := os.Create(*out)
		if err != nil {
			return err
		}
		defer f.Close()
		w = io.MultiWriter(stdout, f)
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("bench: --cpu-profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	return bench.Run(ctx, bench.Options{Binary: *binary, Baseline: *baseline, PDSidecar: *pdSidecar, Quick: *quick, Streams: *streams, Duration: *duration, BatonFlags: strings.Fields(*batonFlags), Plot: *plot, Mixes: mixList, Scenarios: names, Out: w})
}
