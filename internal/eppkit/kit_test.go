package eppkit_test

import (
	"context"
	"io"
	"regexp"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/baton-llm/baton/internal/cli"
	"github.com/baton-llm/baton/internal/eppkit"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// The kit passes every case against `baton epp` over a prefill/decode fleet of vLLM engines:
// the picks name the decode (and the prefill in x-prefiller-host-port), and a subset hint of
// the decode alone gets it. (The run over regular workers is internal/cli's.)
func TestKitAgainstBatonInPDMode(t *testing.T) {
	t.Parallel()
	engine := func(role string) string {
		e, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Role: role, KVConnector: sim.ConnectorNixl, Model: "m"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Close)
		return e.URL()
	}
	prefill, decode := engine(sim.RolePrefill), engine(sim.RoleDecode)
	addr, health := startPicker(t, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--grpc-port", "0", "--grpc-health-port", "0",
		"--pd-disaggregation", "--kv-connector", "NixlConnector", "--prefill", prefill, "--decode", decode)
	k, err := eppkit.Dial(eppkit.Options{Target: addr, Health: health, TLS: true, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	results := k.Run(t.Context())
	if len(results) != eppkit.Cases() {
		t.Errorf("%d results of %d cases", len(results), eppkit.Cases())
	}
	for _, r := range results {
		if !r.Pass {
			t.Errorf("%s: %s", r.Name, r.Detail)
		}
	}
}

// startPicker runs `baton epp` with args until the test ends, and returns its ext_proc and
// plaintext health addresses once it is ready.
func startPicker(t *testing.T, args ...string) (addr, health string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &gwtest.SyncBuffer{}
	res := make(chan error, 1)
	go func() { res <- cli.Run(ctx, append([]string{"epp"}, args...), out, io.Discard) }()
	t.Cleanup(func() {
		cancel()
		if err := <-res; err != nil {
			t.Errorf("baton epp: %v after stop", err)
		}
	})
	healthRE := regexp.MustCompile(`endpoint picker health \(gRPC, plaintext\) on (\S+)`)
	poll.Until(t, "baton epp listening", func() bool { return healthRE.MatchString(out.String()) })
	addr = regexp.MustCompile(`endpoint picker \(ext_proc, gRPC health\) on (\S+)`).FindStringSubmatch(out.String())[1]
	health = healthRE.FindStringSubmatch(out.String())[1]
	conn, err := grpc.NewClient(health, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	poll.Until(t, "the picker ready", func() bool {
		r, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: "readiness"})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})
	return addr, health
}
