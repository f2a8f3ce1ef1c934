package cli

import (
	"context"
	"fmt"
	"io"

	"github.com/baton-llm/baton/internal/sim"
)

// runSim runs one simulated engine until ctx ends.
func runSim(ctx context.Context, args []string, stdout io.Writer) error {
	cfg, err := sim.ParseFlags(newFlagSet("baton sim", stdout), args)
	if err != nil {
		return err
	}
	e, err := sim.Start(cfg)
	if err != nil {
		return err
	}
	defer e.Close()
	fmt.Fprintf(stdout, "sim %s %s (kv connector %s, engine ids %v) serving on %s", cfg.Engine, cfg.Role, cfg.KVConnector, e.EngineIDs(), e.URL())
	if p := e.BootstrapPort(); p != 0 {
		fmt.Fprintf(stdout, " (bootstrap port %d)", p)
	}
	fmt.Fprintln(stdout)
	<-ctx.Done()
	return nil
}
