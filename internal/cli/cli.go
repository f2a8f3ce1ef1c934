// Package cli is the baton command: it runs the gateway (package app), checks a fleet's PD
// handoffs (check), or one of the developer tools beside it — simulated engines, the demo, the
// benchmark harness — with one flag style (--long-names; --help prints the usage and exits 0).
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/baton-llm/baton/internal/app"
	"github.com/baton-llm/baton/internal/config"
)

// Run runs the baton command with args (without the program name) until ctx ends. It returns
// nil after a clean shutdown and config.ErrHelp after printing help.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cmd := "serve"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	if len(args) > 0 && (args[0] == "--version" || args[0] == "-version" || args[0] == "-V" || args[0] == "--version-verbose") {
		cmd = "version" // smg's spellings too
	}
	if cmd == "launch" || cmd == "start" {
		cmd = "serve" // smg's name for running the router (`smg launch`)
	}
	var err error
	switch cmd {
	case "serve":
		err = app.Run(ctx, args, stdout, stderr)
	case "epp":
		err = app.RunEPP(ctx, args, stdout, stderr)
	case "sim":
		err = runSim(ctx, args, stdout)
	case "demo":
		err = runDemo(ctx, args, stdout, stderr)
	case "bench":
		err = runBench(ctx, args, stdout, stderr)
	case "check":
		err = runCheck(ctx, args, stdout, stderr)
	case "epp-conformance":
		err = runEPPConformance(ctx, args, stdout)
	case "hash-key":
		err = hashKey(Stdin, stdout)
	case "version":
		fmt.Fprintln(stdout, app.Version())
	default:
		err = fmt.Errorf("unknown command %q (want serve, epp, check, epp-conformance, sim, demo, bench, hash-key or version; smg's launch is serve)", cmd)
	}
	if errors.Is(err, flag.ErrHelp) {
		return config.ErrHelp // the usage was printed: asking for it is no failure
	}
	return err
}

// Stdin is what hash-key reads.
var Stdin io.Reader = os.Stdin

// maxKey bounds the key hash-key reads.
const maxKey = 64 << 10

// hashKey prints the form a tenant key takes in the configuration: sha256:<hex>, of the one key
// (one line) read from in.
func hashKey(in io.Reader, out io.Writer) error {
	b, err := io.ReadAll(io.LimitReader(in, maxKey+1))
	if err != nil {
		return err
	}
	if len(b) > maxKey {
		return fmt.Errorf("hash-key: the key is longer than %d bytes", maxKey)
	}
	key := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if key == "" || strings.ContainsAny(key, "\r\n") {
		return errors.New("hash-key: give one key, on one line, on standard input (baton hash-key < key.txt)")
	}
	fmt.Fprintln(out, config.HashKey(key))
	return nil
}

// newFlagSet returns a flag set for a tool whose usage lists its flags as --long-names, like
// the gateway's.
func newFlagSet(name string, out io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Usage = func() {
		fmt.Fprintf(out, "usage: %s [flags]\n\n", name)
		tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		defer tw.Flush()
		fs.VisitAll(func(f *flag.Flag) {
			arg, help := flag.UnquoteUsage(f)
			if arg != "" {
				arg = " " + strings.ToUpper(arg)
			}
			if f.DefValue != "" && f.DefValue != "0" && f.DefValue != "false" {
				help += " (default " + f.DefValue + ")"
			}
			fmt.Fprintf(tw, "  --%s%s\t%s\n", f.Name, arg, help)
		})
	}
	return fs
}
