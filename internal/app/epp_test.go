package app

import (
	"context"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/epp/dataplane"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/kvevents"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// startEPP starts a gateway over cfg and its Endpoint Picker on a local gRPC listener, as
// baton epp does; it returns the gateway and a client connection to the picker.
func startEPP(t *testing.T, cfg config.Config, tune ...func(*config.Config)) (*Gateway, *grpc.ClientConn) {
	t.Helper()
	cfg.EPP = true
	g, _ := startGateway(t, cfg, tune...)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, hs := g.NewEPP(g.Config)
	go srv.Serve(ln)
	ctx, cancel := context.WithCancel(context.Background())
	el := &eppListener{srv: srv, ln: ln, health: hs, ready: g.EPPReady, log: g.Log}
	go el.watch(ctx)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(); cancel(); srv.Stop() })
	return g, conn
}

// dataPlane serves a test data plane in front of the picker on conn.
func dataPlane(t *testing.T, conn *grpc.ClientConn, tune ...func(*dataplane.Proxy)) (*dataplane.Proxy, *httptest.Server) {
	t.Helper()
	p := &dataplane.Proxy{Picker: extprocv3.NewExternalProcessorClient(conn), Client: &http.Client{}}
	for _, f := range tune {
		f(p)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	return p, srv
}

func endpointOf(url string) string { return strings.TrimPrefix(url, "http://") }

// A streamed chat completion goes through the data plane to the endpoint the picker named:
// header and metadata agree and list the choice then a fallback; the stream arrives whole; the
// request is Baton's in its metrics (count, TTFT, usage tokens read from the relayed stream)
// and on its status page, and leaves no count in flight. (The picker's own cases are
// internal/epp's; here it runs inside the whole gateway.)
func TestEPPStreamsThroughTheDataPlane(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	b := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL(), b.URL()))
	dp, srv := dataPlane(t, conn)
	resp := post(t, srv.URL+"/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":8,"messages":[{"role":"user","content":"hello there"}]}`)
	body := readAll(t, resp.Body)
	if resp.StatusCode != 200 || !strings.Contains(body, "data: [DONE]") {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	ex := dp.Last()
	eps := strings.Split(ex.Header, ",")
	if ex.Header != ex.Metadata || len(eps) != 2 || eps[0] == eps[1] || ex.Served != eps[0] {
		t.Fatalf("pick %+v", ex)
	}
	for _, ep := range eps {
		if ep != endpointOf(a.URL()) && ep != endpointOf(b.URL()) {
			t.Fatalf("endpoint %q is no worker's", ep)
		}
	}
	// The request ends in Baton's books once the data plane closed the stream, after answering.
	poll.Until(t, "the request counted, with the 8 completion tokens of the relayed stream's usage", func() bool {
		return testutil.ToFloat64(g.Metrics.Requests.WithLabelValues("POST /v1/chat/completions", "m", "200")) == 1 &&
			testutil.ToFloat64(g.Metrics.Tokens.WithLabelValues("m", "completion")) == 8
	})
	if testutil.CollectAndCount(g.Metrics.TTFT) == 0 {
		t.Error("no TTFT observed")
	}
	if n := testutil.ToFloat64(g.Metrics.EPPDecisions.WithLabelValues("picked")); n != 1 {
		t.Errorf("decisions: %v", n)
	}
	for _, w := range g.Registry.Snapshot().Workers {
		if w.InFlight() != 0 {
			t.Errorf("%s: %d in flight after the response", w.URL, w.InFlight())
		}
	}
	status := httptest.NewServer(g.Server.StatusHandler())
	defer status.Close()
	sresp, err := http.Get(status.URL + "/status.json")
	if err != nil {
		t.Fatal(err)
	}
	var page struct {
		LastMinute struct {
			RPS float64 `json:"rps"`
		} `json:"last_minute"`
	}
	json.NewDecoder(sresp.Body).Decode(&page)
	sresp.Body.Close()
	if page.LastMinute.RPS <= 0 {
		t.Errorf("the picker's request is not on the status page: %+v", page)
	}
}

// The gRPC health services: liveness serves always; readiness and the ExternalProcessor
// service serve while a worker is ready, and stop when none is.
func TestEPPHealthServices(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL()))
	hc := healthpb.NewHealthClient(conn)
	check := func(svc string) healthpb.HealthCheckResponse_ServingStatus {
		r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatalf("%s: %v", svc, err)
		}
		return r.GetStatus()
	}
	serving := healthpb.HealthCheckResponse_SERVING
	poll.Until(t, "ready", func() bool {
		return check("readiness") == serving && check(extprocv3.ExternalProcessor_ServiceDesc.ServiceName) == serving
	})
	if check("liveness") != serving {
		t.Fatal("not live")
	}
	if _, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "no-such-service"}); status.Code(err) != codes.NotFound {
		t.Errorf("unknown service: %v", err)
	}
	g.Registry.Snapshot().Workers[0].SetCordoned(true)
	poll.Until(t, "not ready without a worker", func() bool {
		return check("readiness") != serving && check(extprocv3.ExternalProcessor_ServiceDesc.ServiceName) != serving
	})
	if check("liveness") != serving {
		t.Fatal("liveness follows readiness")
	}
}

// Prefill/decode through the Endpoint Picker with Baton at both ends: the picker answers the
// decode side as the destination and names the prefill in x-prefiller-host-port; the
// destination is a Baton sidecar in front of the decode engine, which runs the prefill leg on
// the prefill named (not one of its own choosing) and hands the KV over — vLLM's NIXL relay and
// SGLang's bootstrap rendezvous alike. A header naming no
// prefill of the sidecar's is refused 503; without the header the sidecar chooses itself.
func TestEPPDisaggregatedWithBatonSidecar(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ engine, handoff string }{{sim.EngineVLLM, "nixl"}, {sim.EngineSGLang, "bootstrap"}} {
		t.Run(tc.engine, func(t *testing.T) {
			t.Parallel()
			var prefills []config.Worker
			for i := 0; i < 2; i++ {
				p := simEngine(t, sim.Config{Engine: tc.engine, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
				w := config.Worker{URL: p.URL(), Role: config.RolePrefill}
				if tc.engine == sim.EngineVLLM {
					w.KVConnector = "NixlConnector"
				} else {
					port := p.BootstrapPort()
					w.BootstrapPort = &port
				}
				prefills = append(prefills, w)
			}
			d := simEngine(t, sim.Config{Engine: tc.engine, Role: sim.RoleDecode})
			side := config.Default()
			side.PDDisaggregation, side.PDPrefillerHeader = true, true
			side.Workers = append(append([]config.Worker{}, prefills...), config.Worker{URL: d.URL(), Role: config.RoleDecode})
			sg, sidecar := startGateway(t, side)

			pick := config.Default()
			pick.PDDisaggregation = true
			decode := config.Worker{URL: sidecar.URL, Role: config.RoleDecode, Runtime: tc.engine}
			if tc.engine == sim.EngineVLLM {
				decode.KVConnector = "NixlConnector"
			}
			pick.Workers = append(append([]config.Worker{}, prefills...), decode)
			_, conn := startEPP(t, pick)
			dp, srv := dataPlane(t, conn)
			used := map[string]int{}
			for i := 0; i < 6; i++ {
				resp := post(t, srv.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"tell me a story number %d","max_tokens":4}`, pdModel, i))
				body := readAll(t, resp.Body)
				ex := dp.Last()
				if resp.StatusCode != 200 || ex.Header != endpointOf(sidecar.URL) {
					t.Fatalf("%d %s (pick %+v)", resp.StatusCode, body, ex)
				}
				if got := resp.Header.Get("X-Baton-Prefill-Worker"); "http://"+ex.Prefiller != got {
					t.Fatalf("the picker named prefill %s, the sidecar used %s", ex.Prefiller, got)
				}
				if h, src := resp.Header.Get("X-Baton-Kv-Handoff"), resp.Header.Get(sim.HeaderKVSource); h != tc.handoff || src != sim.SourceRemote {
					t.Fatalf("handoff %q, the decode's KV source %q", h, src)
				}
				used[ex.Prefiller]++
			}
			if len(used) != 2 {
				t.Errorf("the picker named one prefill only: %v", used)
			}
			if st := d.Stats(); st.PromptTokensRemote == 0 {
				t.Errorf("decode: no prompt token received from a prefill")
			}
			resp := post(t, sidecar.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"x","max_tokens":2}`, pdModel), epp.HeaderPrefiller, "10.255.0.1:8000")
			wantEnvelope(t, resp, 503, "no_available_workers")
			// Without the header the picker decided the decode serves alone (llm-d's sidecar
			// does so): a vLLM decode computes the prompt, said in the handoff header; SGLang's
			// decode mode cannot serve without a bootstrap, so there a prefill is picked.
			resp = post(t, sidecar.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"x","max_tokens":2}`, pdModel))
			readAll(t, resp.Body)
			switch {
			case tc.engine == sim.EngineVLLM && (resp.StatusCode != 200 || resp.Header.Get("X-Baton-Prefill-Worker") != "" || resp.Header.Get("X-Baton-Kv-Handoff") != "none-local-prefill"):
				t.Errorf("vLLM without the header: %d, prefill %q, handoff %q", resp.StatusCode, resp.Header.Get("X-Baton-Prefill-Worker"), resp.Header.Get("X-Baton-Kv-Handoff"))
			case tc.engine == sim.EngineSGLang && (resp.StatusCode != 200 || resp.Header.Get("X-Baton-Prefill-Worker") == ""):
				t.Errorf("SGLang without the header: %d, prefill %q", resp.StatusCode, resp.Header.Get("X-Baton-Prefill-Worker"))
			}
			if tc.engine == sim.EngineVLLM {
				// Counted once it ended whole, in both counters and on the status page.
				poll.Until(t, "the request served alone counted", func() bool { return sg.Server.Director().LocalPrefills() == 1 })
				if n := testutil.ToFloat64(sg.Metrics.PDHandoffs.WithLabelValues("none-local-prefill", "by_design", "")); n != 1 {
					t.Errorf("baton_pd_kv_handoffs_total{none-local-prefill} %v, want 1", n)
				}
			}
			// llm-d's picker may list several prefills (its sidecar samples or takes the first):
			// the first that is one of the sidecar's prefill workers serves.
			list := "10.255.0.1:8000, " + endpointOf(prefills[1].URL) + "," + endpointOf(prefills[0].URL)
			resp = post(t, sidecar.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"y","max_tokens":2}`, pdModel), epp.HeaderPrefiller, list)
			if readAll(t, resp.Body); resp.StatusCode != 200 || resp.Header.Get("X-Baton-Prefill-Worker") != prefills[1].URL {
				t.Errorf("a listed header %q: %d, prefill %q", list, resp.StatusCode, resp.Header.Get("X-Baton-Prefill-Worker"))
			}
		})
	}
}

// The picker continues the caller's trace: its server span (named after the route) is a child
// of the traceparent the gateway forwarded, with the selection under it and the worker chosen.
func TestEPPContinuesTheTrace(t *testing.T) {
	rc := newOTLPReceiver(t)
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL()))
	_, srv := dataPlane(t, conn)
	const traceID, parentID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	spans := rc.capture(t, func() {
		resp := post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":2}`, "Traceparent", "00-"+traceID+"-"+parentID+"-01")
		if readAll(t, resp.Body); resp.StatusCode != 200 {
			t.Fatalf("%d", resp.StatusCode)
		}
		poll.Until(t, "the request ended", func() bool { return g.Server.InFlight() == 0 })
	})
	server := one(t, spans, "POST /v1/completions")
	if hex.EncodeToString(server.TraceId) != traceID || hex.EncodeToString(server.ParentSpanId) != parentID {
		t.Errorf("the picker's span is not in the caller's trace: trace %x parent %x", server.TraceId, server.ParentSpanId)
	}
	if attr(server, "baton.worker") != a.URL() || attr(server, "http.response.status_code") != "200" {
		t.Errorf("server span: worker %q status %q", attr(server, "baton.worker"), attr(server, "http.response.status_code"))
	}
	childOf(t, one(t, spans, "select"), server)
}

// Several pickers agree without talking to each other: each subscribes to the engines' KV
// events, so each sends a prompt to the engine that holds its prefix, whichever replica the
// gateway asks.
func TestEPPReplicasAgreeThroughKVEvents(t *testing.T) {
	t.Parallel()
	var es []*sim.Engine
	cfg := config.Default()
	cfg.Policy = config.PolicyCacheAware
	for i := 0; i < 3; i++ {
		e := simEngine(t, sim.Config{Engine: sim.EngineVLLM, PrefixCache: true, KVEvents: true})
		es = append(es, e)
		cfg.Workers = append(cfg.Workers, config.Worker{URL: e.URL(), KVEventsEndpoint: e.KVEventsEndpoint()})
	}
	g1, c1 := startEPP(t, cfg)
	g2, c2 := startEPP(t, cfg)
	waitHealthy(t, es, g1, g2)
	dp1, s1 := dataPlane(t, c1)
	dp2, s2 := dataPlane(t, c2)
	for p := 0; p < 6; p++ {
		prompt := fmt.Sprintf("team %d: %s", p, strings.Repeat("a long shared system prompt for this team ", 8))
		home := es[p%len(es)]
		resp, body := gwtest.PostTimeout(t, home.URL()+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, pdModel, prompt))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		keys := kvevents.Keys(pdModel, "", sim.Tokenize(prompt), 16)
		poll.Until(t, "both pickers learned the prompt", func() bool {
			return g1.KVEvents.Index.Match(keys)[home.URL()] == len(keys) && g2.KVEvents.Index.Match(keys)[home.URL()] == len(keys)
		})
		for i, front := range []*httptest.Server{s1, s2} {
			resp := post(t, front.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, pdModel, prompt+" and a question"))
			readAll(t, resp.Body)
			if served := []*dataplane.Proxy{dp1, dp2}[i].Last().Served; resp.StatusCode != 200 || served != endpointOf(home.URL()) {
				t.Errorf("prompt %d, picker %d: %d, served by %s, cached on %s", p, i+1, resp.StatusCode, served, endpointOf(home.URL()))
			}
		}
	}
}

// Past epp_max_connections a new connection to the picker's port is closed at once and
// counted; a closed one frees its place.
func TestEPPConnectionsAreBounded(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	cfg := testConfig(a.URL())
	cfg.EPP = true
	g, _ := startGateway(t, cfg)
	c := g.Config
	c.Host, c.GRPCPort, c.GRPCHealthPort, c.EPPSecureServing, c.EPPMaxConnections = "127.0.0.1", 0, -1, false, 2
	el, err := g.listenEPP(c)
	if err != nil {
		t.Fatal(err)
	}
	el.serve()
	t.Cleanup(func() { el.stop(time.Now()) })
	dial := func() *grpc.ClientConn {
		conn, err := grpc.NewClient(el.ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		return conn
	}
	live := func(conn *grpc.ClientConn) error {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "liveness"})
		return err
	}
	first, second := dial(), dial()
	defer second.Close()
	for _, conn := range []*grpc.ClientConn{first, second} {
		if err := live(conn); err != nil {
			t.Fatal(err)
		}
	}
	third := dial()
	defer third.Close()
	if err := live(third); err == nil {
		t.Error("a third connection was served past epp_max_connections 2")
	}
	if n := testutil.ToFloat64(g.Metrics.EPPCut.WithLabelValues("max_connections")); n < 1 {
		t.Errorf("max_connections counted %v", n)
	}
	first.Close()
	poll.Until(t, "the closed connection's place taken by another", func() bool {
		conn := dial()
		defer conn.Close()
		return live(conn) == nil
	})
}

// The data plane forwards a picked request, so an engine's refusal of an adapter another
// replica unloaded reaches that client; the picker then reads the worker's models again, so the
// next request for the adapter has it loaded again instead of meeting the same refusal.
func TestEPPRelearnsAnAdapterGone(t *testing.T) {
	t.Parallel()
	e := loraEngine(t, sim.Config{Model: "base"})
	cfg := testConfig(e.URL())
	cfg.LoadPollInterval = time.Hour // the picker learns of the unload only from the answer
	cfg.Adapters = []config.Adapter{{Name: "sql", Path: "/adapters/sql", Base: "base"}}
	_, conn := startEPP(t, cfg)
	_, srv := dataPlane(t, conn)
	ask := func() (int, string) {
		resp := post(t, srv.URL+"/v1/completions", `{"model":"sql","prompt":"x","max_tokens":2}`)
		return resp.StatusCode, readAll(t, resp.Body)
	}
	if st, b := ask(); st != 200 {
		t.Fatalf("first: %d %s", st, b)
	}
	resp, err := http.Post(e.URL()+"/v1/unload_lora_adapter", "application/json", strings.NewReader(`{"lora_name":"sql"}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("the other replica's unload: %v %v", resp, err)
	}
	resp.Body.Close()
	if st, b := ask(); st != 404 {
		t.Fatalf("the request the data plane forwarded after the unload: %d %s (the engine's 404 expected)", st, b)
	}
	poll.Until(t, "the next request has the adapter loaded again", func() bool {
		st, _ := ask()
		return st == 200
	})
	if l, _ := e.LoRAStats(); l != 2 {
		t.Errorf("loads %d, want 2", l)
	}
}

// A silent TCP connection (not even a TLS ClientHello) holds its place among the picker's
// connections for the 5 s handshake bound, not gRPC's 120 s.
func TestEPPSilentSocketsHoldTheirPlaceBriefly(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, _ := startEPP(t, testConfig(a.URL()))
	cfg := g.Config
	cfg.Host, cfg.GRPCPort, cfg.GRPCHealthPort, cfg.EPPSecureServing, cfg.EPPMaxConnections = "127.0.0.1", 0, -1, true, 2
	el, err := g.listenEPP(cfg)
	if err != nil {
		t.Fatal(err)
	}
	el.serve()
	t.Cleanup(func() { el.stop(time.Now()) })
	for range 2 {
		c, err := net.Dial("tcp", el.ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	tconn, err := grpc.NewClient(el.ln.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{InsecureSkipVerify: true})))
	if err != nil {
		t.Fatal(err)
	}
	defer tconn.Close()
	poll.Until(t, "a gateway served once the silent sockets were closed (within the handshake bound)", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_, err := healthpb.NewHealthClient(tconn).Check(ctx, &healthpb.HealthCheckRequest{Service: "liveness"})
		return err == nil
	})
}
