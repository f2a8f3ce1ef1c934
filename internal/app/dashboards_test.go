package app

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/discovery"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/redistest"
	"github.com/baton-llm/baton/internal/sim"
)

var metricName = regexp.MustCompile(`\bbaton_[a-z0-9_]+`)

// exprsOf returns the PromQL of the Grafana dashboard and of the alert rules.
func exprsOf(t *testing.T) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	b, err := os.ReadFile("../../deploy/grafana/baton.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("dashboard: %v", err)
	}
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			out["dashboard: "+p.Title] = append(out["dashboard: "+p.Title], tg.Expr)
		}
	}
	b, err = os.ReadFile("../../deploy/prometheus/alerts.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var rules struct {
		Groups []struct {
			Rules []struct{ Alert, Expr string }
		}
	}
	if err := yaml.Unmarshal(b, &rules); err != nil {
		t.Fatalf("alerts: %v", err)
	}
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			out["alert: "+r.Alert] = append(out["alert: "+r.Alert], r.Expr)
		}
	}
	return out
}

// exported drives traffic through two gateways that touch what the dashboard and alerts read
// (a vLLM PD pair whose prefill publishes KV events, a regular fleet with a failing worker,
// retries, a full queue, an admin change) and returns the metric names their /metrics show.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	names := map[string]bool{}
	scrapeNames := func(g *Gateway) {
		for _, line := range strings.Split(scrape(t, g), "\n") {
			if line == "" || line[0] == '#' {
				continue
			}
			names[strings.FieldsFunc(line, func(r rune) bool { return r == '{' || r == ' ' })[0]] = true
		}
	}

	p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, EngineID: "engine-p", PrefixCache: true, KVEvents: true})
	d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl, DecodePerToken: time.Millisecond})
	cfg := config.Default()
	cfg.PDDisaggregation, cfg.ForwardSimFaults, cfg.Policy, cfg.Host, cfg.AdminAPIKey = true, true, config.PolicyCacheAware, "127.0.0.1", "sk-admin"
	cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector", KVEventsEndpoint: p.KVEventsEndpoint()}, {URL: d.URL(), Role: config.RoleDecode}}
	g, gw := startGateway(t, cfg)
	waitHealthy(t, []*sim.Engine{p}, g)
	for i := 0; i < 3; i++ {
		gwtest.PostTimeout(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"dashboards %d","max_tokens":4,"stream":true,"stream_options":{"include_usage":true}}`, pdModel, i))
	}
	req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/completions", strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"x","max_tokens":2}`, pdModel)))
	req.Header.Set("X-Sim-Fault", "status=503")
	if resp, err := http.DefaultClient.Do(req); err == nil {
		resp.Body.Close()
	}
	if status, body := admin(t, http.MethodPost, gw.URL+"/workers", "sk-admin", `{"url":"http://127.0.0.1:9","role":"decode"}`); status != 202 {
		t.Fatalf("admin add: %d %s", status, body)
	}
	g.UseDiscovery(&discovery.Discovery{}) // its metric, as a gateway with --service-discovery shows it
	scrapeNames(g)

	bad := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{Status: 503}})
	slow := simEngine(t, sim.Config{Engine: sim.EngineVLLM, DecodePerToken: 50 * time.Millisecond})
	rcfg := testConfig(bad.URL(), slow.URL())
	rcfg.Admission.MaxConcurrentRequests, rcfg.Admission.QueueSize, rcfg.Admission.QueueTimeout = 1, 1, time.Second
	rg, rgw := startGateway(t, rcfg)
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ { // one runs, one waits, the rest are refused: queue_full
		wg.Go(func() {
			gwtest.PostTimeout(t, rgw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"q","max_tokens":8}`, pdModel))
		})
	}
	wg.Wait()
	scrapeNames(rg)

	// A tenant over its limit, counted in a real Redis.
	rs := redistest.Start(t)
	tcfg := testConfig(slow.URL())
	tcfg.RateLimitStore = rs.URL()
	tcfg.Tenants = []config.Tenant{{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{RequestsPerMinute: intp(1)}}}
	tg, tgw := startGateway(t, tcfg)
	for i := 0; i < 2; i++ {
		tenantReq(t, tgw.URL+"/v1/completions", "sk-team", fmt.Sprintf(`{"model":%q,"prompt":"q","max_tokens":2}`, pdModel))
	}
	scrapeNames(tg)
	return names
}

// Every metric the Grafana dashboard and the alert rules read is one Baton exports (scraped from
// running gateways), and promtool accepts the rules.
func TestDashboardsUseExportedMetrics(t *testing.T) {
	t.Parallel()
	exprs := exprsOf(t)
	if len(exprs) < 20 {
		t.Fatalf("only %d panels and rules found", len(exprs))
	}
	names := exported(t)
	var missing []string
	for where, es := range exprs {
		for _, e := range es {
			for _, n := range metricName.FindAllString(e, -1) {
				if !names[n] {
					missing = append(missing, fmt.Sprintf("%s uses %s", where, n))
				}
			}
		}
	}
	sort.Strings(missing)
	for _, m := range missing {
		t.Error(m + ", which Baton does not export")
	}

	promtool, err := exec.LookPath("promtool")
	if err != nil {
		msg := "SKIPPED promtool check: no promtool (Debian's prometheus package has it; CI installs it)"
		if os.Getenv("BATON_REQUIRE_TOOLS") != "" {
			t.Fatal("BATON_REQUIRE_TOOLS is set but " + msg)
		}
		t.Log(msg)
		return
	}
	if out, err := exec.Command(promtool, "check", "rules", "../../deploy/prometheus/alerts.yaml").CombinedOutput(); err != nil {
		t.Errorf("promtool check rules: %v\n%s", err, out)
	}
}
