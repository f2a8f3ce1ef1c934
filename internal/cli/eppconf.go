package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/baton-llm/baton/internal/eppkit"
)

// runEPPConformance runs the Endpoint Picker conformance kit against a picker's address, or
// loads it at a rate (--load).
func runEPPConformance(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlagSet("baton epp-conformance", stdout)
	target := fs.String("target", "", "the picker's ext_proc gRPC address, HOST:PORT (required)")
	health := fs.String("health", "", "its gRPC health address when it is another (plaintext)")
	useTLS := fs.Bool("tls", false, "speak TLS to --target (the certificate is not verified)")
	model := fs.String("model", "", "a model the picker's endpoints serve (required)")
	path := fs.String("path", "/v1/completions", "the inference path the requests name")
	asJSON := fs.Bool("json", false, "print the results as JSON")
	load := fs.Float64("load", 0, "instead of the cases: whole exchanges at this many per second, open loop, and the pick's latency")
	duration := fs.Duration("duration", 10*time.Second, "how long --load runs")
	timeout := fs.Duration("timeout", 10*time.Second, "how long one case (or one exchange of --load) may take")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *target == "" || *model == "" {
		return errors.New("epp-conformance: give --target HOST:PORT and --model NAME")
	}
	k, err := eppkit.Dial(eppkit.Options{Target: *target, Health: *health, TLS: *useTLS, Model: *model, Path: *path, Timeout: *timeout})
	if err != nil {
		return fmt.Errorf("epp-conformance: %w", err)
	}
	defer k.Close()
	if *load > 0 {
		r := k.Load(ctx, *load, *duration)
		if *asJSON {
			return json.NewEncoder(stdout).Encode(r)
		}
		fmt.Fprintf(stdout, "%d sent at %.0f/s: %d picked (%.0f/s), %d failed; pick p50 %s, p99 %s, max %s\n",
			r.Sent, *load, r.Picked, r.Rate, r.Failed, r.P50, r.P99, r.Max)
		if r.FirstError != "" {
			fmt.Fprintf(stdout, "first error: %s\n", r.FirstError)
		}
		if r.Failed > 0 {
			return fmt.Errorf("epp-conformance: %d of %d exchanges failed", r.Failed, r.Sent)
		}
		return nil
	}
	results := k.Run(ctx)
	failed := 0
	for _, r := range results {
		if !r.Pass {
			failed++
		}
	}
	if *asJSON {
		if err := json.NewEncoder(stdout).Encode(results); err != nil {
			return err
		}
	} else {
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "CASE\tRESULT\tCHECKS\tDETAIL")
		for _, r := range results {
			verdict := "pass"
			if !r.Pass {
				verdict = "FAIL"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.Name, verdict, r.Spec, r.Detail)
		}
		_ = tw.Flush()
		fmt.Fprintf(stdout, "%d of %d cases passed\n", len(results)-failed, len(results))
	}
	if failed > 0 {
		return fmt.Errorf("epp-conformance: %d of %d cases failed", failed, len(results))
	}
	return nil
}
