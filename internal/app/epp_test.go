package app

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
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
	"github.com/baton-llm/baton/internal/worker"
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
// and leaves no count in flight.
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
}

// A body larger than a gRPC message (4 MiB by default) is assembled from the proxy's chunks,
// read, and handed back byte for byte — unknown keys, big integers and unicode included — in
// chunks a message holds, in full duplex and buffered modes.
func TestEPPHandsALargeBodyBackUnchanged(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []byte
	up := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = b
		mu.Unlock()
		io.WriteString(w, `{"choices":[]}`)
	})
	_, conn := startEPP(t, testConfig(up.URL))
	body := `{"model":"m","x_unknown":{"n":12345678901234567890,"s":"héllo ✓ \u00e9"},"messages":[{"role":"user","content":"` + strings.Repeat("y", 6<<20) + `"}]}`
	for _, buffered := range []bool{false, true} {
		t.Run(fmt.Sprintf("buffered=%v", buffered), func(t *testing.T) {
			_, srv := dataPlane(t, conn, func(p *dataplane.Proxy) { p.Buffered, p.ChunkSize = buffered, 64<<10 })
			resp := post(t, srv.URL+"/v1/chat/completions", body)
			if b := readAll(t, resp.Body); resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			mu.Lock()
			defer mu.Unlock()
			if !bytes.Equal(got, []byte(body)) {
				t.Fatalf("the engine got %d bytes, not the %d sent", len(got), len(body))
			}
		})
	}
}

// The subset hint: only its endpoints are picked; an empty subset, or one with no eligible
// endpoint, is an immediate 503.
func TestEPPSubsetHint(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	b := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	_, conn := startEPP(t, testConfig(a.URL(), b.URL()))
	var subset []string
	dp, srv := dataPlane(t, conn, func(p *dataplane.Proxy) { p.Subset = func(*http.Request) []string { return subset } })
	req := `{"model":"m","max_tokens":2,"prompt":"hi"}`
	for i := 0; i < 4; i++ {
		subset = []string{endpointOf(b.URL())}
		resp := post(t, srv.URL+"/v1/completions", req)
		readAll(t, resp.Body)
		if ex := dp.Last(); resp.StatusCode != 200 || ex.Header != endpointOf(b.URL()) {
			t.Fatalf("subset of b: %d %+v", resp.StatusCode, ex)
		}
	}
	// No worker's ip:port in the hint, but their IP: matched by IP, as the reference picker does.
	for _, sub := range [][]string{{"127.0.0.1:1"}, {"127.0.0.1"}} {
		subset = sub
		resp := post(t, srv.URL+"/v1/completions", req)
		readAll(t, resp.Body)
		if ex := dp.Last(); resp.StatusCode != 200 || ex.Header == "" {
			t.Errorf("subset %v (the workers' IP): %d %+v", sub, resp.StatusCode, ex)
		}
	}
	for name, sub := range map[string][]string{"empty": {}, "ineligible": {"10.255.0.1:9", "not-an-endpoint"}} {
		subset = sub
		resp := post(t, srv.URL+"/v1/completions", req)
		wantEnvelope(t, resp, 503, "no_endpoint_in_subset")
		if ex := dp.Last(); ex.Immediate != 503 || len(ex.Tried) != 0 {
			t.Errorf("%s subset: %+v", name, ex)
		}
	}
}

// A batch request is shed (429, Retry-After) when every worker that could serve it queues
// past the threshold; a default-class request still goes through.
func TestEPPShedsBatchUnderLoad(t *testing.T) {
	t.Parallel()
	metrics := "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 9\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 4\n"
	up := fakeEngineWith(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			io.WriteString(w, metrics)
			return
		}
		io.ReadAll(r.Body)
		io.WriteString(w, `{"choices":[]}`)
	}, true)
	g, conn := startEPP(t, testConfig(up.URL), func(c *config.Config) { c.LoadPollInterval = 50 * time.Millisecond })
	poll.Until(t, "the engine's queue is known", func() bool { return g.Registry.Snapshot().Workers[0].EngineLoad().Waiting == 9 })
	_, srv := dataPlane(t, conn)
	resp := post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Baton-Priority", "batch")
	wantEnvelope(t, resp, 429, "request_shed")
	if resp.Header.Get("Retry-After") == "" {
		t.Error("no Retry-After")
	}
	resp = post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if readAll(t, resp.Body); resp.StatusCode != 200 {
		t.Fatalf("default class: %d", resp.StatusCode)
	}
}

// No available endpoint: an immediate 503; bad requests: the OpenAI envelope with the right
// status, nothing picked.
func TestEPPRefusals(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL()), func(c *config.Config) { c.MaxPayloadSize = 1 << 20; c.MaxBufferedBodyBytes = 4 << 20 })
	_, srv := dataPlane(t, conn)
	for _, tc := range []struct {
		body   string
		status int
		code   string
	}{
		{`{"model":`, 400, "invalid_json"},
		{``, 400, "invalid_json"},
		{`{"messages":[]}`, 400, "model_required"},
		{`{"model":"m","model":"n"}`, 400, "duplicate_key"},
		{`{"model":"nobody-serves-this","prompt":"x"}`, 404, "model_not_found"},
		{`{"model":"m","prompt":"` + strings.Repeat("z", 1<<20) + `"}`, 413, "payload_too_large"},
	} {
		resp := post(t, srv.URL+"/v1/completions", tc.body)
		wantEnvelope(t, resp, tc.status, tc.code)
	}
	resp := post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Baton-Priority", "urgent!")
	wantEnvelope(t, resp, 400, "invalid_priority")
	g.Registry.Snapshot().Workers[0].SetCordoned(true)
	resp = post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	wantEnvelope(t, resp, 503, "no_available_workers")
	if n := testutil.ToFloat64(g.Metrics.EPPDecisions.WithLabelValues("no_available_workers")); n != 1 {
		t.Errorf("refusals counted: %v", n)
	}
}

// rawStream opens an ext_proc stream and sends a request's headers and body as Envoy does.
func rawStream(t *testing.T, ctx context.Context, conn *grpc.ClientConn, body string) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []*extprocv3.ProcessingRequest{
		dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", http.Header{"Content-Type": {"application/json"}}, false),
		dataplane.RequestBody([]byte(body), true),
	} {
		if err := st.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	return st
}

// recvPick reads the request path's answers up to the end of the handed-back body and returns
// the destination list.
func recvPick(t *testing.T, st extprocv3.ExternalProcessor_ProcessClient) []string {
	t.Helper()
	var dest string
	for {
		m, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if h := m.GetRequestHeaders(); h != nil {
			for _, s := range h.GetResponse().GetHeaderMutation().GetSetHeaders() {
				if s.GetHeader().GetKey() == epp.HeaderDestination {
					dest = string(s.GetHeader().GetRawValue())
				}
			}
		}
		if sr := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil && sr.GetEndOfStream() {
			return strings.Split(dest, ",")
		}
	}
}

// The served endpoint read back: when the proxy reports a fallback served, the request's count
// in flight moves to that worker, and the move is counted; the end of the response ends it.
// A proxy that cancels the stream mid-response ends the request too (499), nothing left in
// flight.
func TestEPPServedEndpointAndCancel(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	b := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL(), b.URL()))
	byEndpoint := map[string]*worker.Worker{}
	for _, w := range g.Registry.Snapshot().Workers {
		byEndpoint[w.Endpoint] = w
	}
	st := rawStream(t, context.Background(), conn, `{"model":"m","prompt":"x"}`)
	eps := recvPick(t, st)
	if len(eps) != 2 || byEndpoint[eps[0]].InFlight() != 1 {
		t.Fatalf("pick %v, in flight on the choice %d", eps, byEndpoint[eps[0]].InFlight())
	}
	st.Send(dataplane.ResponseHeaders(http.StatusOK, nil, eps[1], false))
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	if byEndpoint[eps[0]].InFlight() != 0 || byEndpoint[eps[1]].InFlight() != 1 {
		t.Fatalf("after the served endpoint: %d, %d", byEndpoint[eps[0]].InFlight(), byEndpoint[eps[1]].InFlight())
	}
	if n := testutil.ToFloat64(g.Metrics.EPPServedFallback); n != 1 {
		t.Errorf("served by a fallback: %v", n)
	}
	st.Send(dataplane.ResponseBody([]byte(`{"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}`), true))
	if m, err := st.Recv(); err != nil || !strings.Contains(string(m.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody()), "completion_tokens") {
		t.Fatalf("the response body was not handed back: %v %v", m, err)
	}
	st.CloseSend()
	st.Recv()
	poll.Until(t, "the request ended", func() bool { return byEndpoint[eps[1]].InFlight() == 0 })
	poll.Until(t, "the request counted", func() bool {
		return testutil.ToFloat64(g.Metrics.Requests.WithLabelValues("POST /v1/completions", "m", "200")) == 1
	})

	ctx, cancel := context.WithCancel(context.Background())
	st = rawStream(t, ctx, conn, `{"model":"m","prompt":"x"}`)
	eps = recvPick(t, st)
	cancel()
	poll.Until(t, "the cancelled request ended", func() bool {
		return byEndpoint[eps[0]].InFlight() == 0 && testutil.ToFloat64(g.Metrics.Requests.WithLabelValues("POST /v1/completions", "m", "499")) == 1
	})
}

// rawCodec sends bytes as they are: a malformed message.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error)      { return v.([]byte), nil }
func (rawCodec) Unmarshal(data []byte, v any) error { *(v.(*[]byte)) = data; return nil }
func (rawCodec) Name() string                       { return "proto" }

// Malformed messages and messages out of order end their stream with an error; the picker
// serves the next stream as before.
func TestEPPBadProtocolInput(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	_, conn := startEPP(t, testConfig(a.URL()))
	desc := &grpc.StreamDesc{StreamName: "Process", ServerStreams: true, ClientStreams: true}
	st, err := conn.NewStream(context.Background(), desc, "/envoy.service.ext_proc.v3.ExternalProcessor/Process", grpc.ForceCodec(rawCodec{}))
	if err != nil {
		t.Fatal(err)
	}
	st.SendMsg([]byte{0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01})
	var out []byte
	if err := st.RecvMsg(&out); status.Code(err) == codes.OK {
		t.Fatalf("a malformed message answered: %v", err)
	}

	pst, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	pst.Send(dataplane.RequestBody([]byte("{}"), true))
	if _, err := pst.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("a body before headers: %v", err)
	}
	pst, _ = extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
	pst.Send(dataplane.ResponseHeaders(http.StatusOK, nil, "", false))
	if _, err := pst.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("response headers before the request: %v", err)
	}
	st2 := rawStream(t, context.Background(), conn, `{"model":"m","prompt":"x"}`)
	if eps := recvPick(t, st2); eps[0] != endpointOf(a.URL()) {
		t.Fatalf("after bad streams: %v", eps)
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

// An alias, and the default model of a request that names none, are renamed to the workers'
// model in the body handed back (its length set anew). A client's own x-prefiller-host-port
// never reaches an engine: the picker removes it when it names no prefill.
func TestEPPRenamesAnAlias(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got map[string]any
	var length, prefiller string
	up := fakeEngine(t, "vllm", []string{"big-model"}, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		json.NewDecoder(r.Body).Decode(&got)
		length, prefiller = r.Header.Get("Content-Length"), r.Header.Get(epp.HeaderPrefiller)
		io.WriteString(w, `{"choices":[]}`)
	})
	cfg := testConfig(up.URL)
	cfg.Models = map[string]config.ModelConfig{"small": {Serve: "big-model"}}
	cfg.DefaultModel = "small"
	_, conn := startEPP(t, cfg)
	_, srv := dataPlane(t, conn)
	for _, body := range []string{`{"model":"small","prompt":"x"}`, `{"prompt":"x"}`} {
		resp := post(t, srv.URL+"/v1/completions", body, epp.HeaderPrefiller, "10.0.0.9:8000")
		if b := readAll(t, resp.Body); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", body, resp.StatusCode, b)
		}
		mu.Lock()
		if got["model"] != "big-model" || got["prompt"] != "x" || length == fmt.Sprint(len(body)) {
			t.Errorf("%s: engine got %v (length %s)", body, got, length)
		}
		if prefiller != "" {
			t.Errorf("the client's %s reached the engine: %q", epp.HeaderPrefiller, prefiller)
		}
		mu.Unlock()
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
			_, sidecar := startGateway(t, side)

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

// Time and size bound what a proxy may send: an exchange past the request deadline (plus a
// grace) is ended, the request with it; too many header fields are refused 431, the refusal the
// only answer in every body mode.
func TestEPPBoundsTheExchange(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL()), requestTimeout(300*time.Millisecond))
	st := rawStream(t, context.Background(), conn, `{"model":"m","prompt":"x"}`)
	recvPick(t, st) // then the proxy goes silent
	w := g.Registry.Snapshot().Workers[0]
	if w.InFlight() != 1 {
		t.Fatalf("in flight: %d", w.InFlight())
	}
	if _, err := st.Recv(); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("a silent exchange: %v", err)
	}
	poll.Until(t, "the request ended", func() bool { return w.InFlight() == 0 })

	flood := http.Header{}
	for i := 0; i < 300; i++ {
		flood.Set(fmt.Sprintf("x-h%d", i), "v")
	}
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED} {
		pst, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		first := dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", flood, false)
		first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode}
		pst.Send(first)
		m, err := pst.Recv()
		if err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 431 {
			t.Fatalf("%s, 300 header fields: %v %v", mode, m, err)
		}
		pst.CloseSend()
		if m, err := pst.Recv(); err != io.EOF { // the refusal is the only answer
			t.Errorf("%s: after the refusal: %v %v", mode, m, err)
		}
	}
}

// The data plane goes down the list: when the chosen endpoint refuses connections (its engine
// gone before Baton noticed), the next one serves, the proxy says so, and Baton moves the
// request there and counts it. The requests are on the status page like proxied ones.
func TestEPPFallbackDownTheList(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	b := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL(), b.URL()), func(c *config.Config) { c.HealthCheck.Disable = true })
	a.Close() // Baton still holds a available: nothing it does asks a before the picks
	dp, srv := dataPlane(t, conn)
	var fellBack int
	for i := 0; i < 4; i++ {
		resp := post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":2}`)
		body := readAll(t, resp.Body)
		ex := dp.Last()
		if resp.StatusCode != 200 || ex.Served != endpointOf(b.URL()) {
			t.Fatalf("%d %s (%+v)", resp.StatusCode, body, ex)
		}
		if len(ex.Tried) == 2 {
			fellBack++
		}
	}
	if fellBack == 0 || testutil.ToFloat64(g.Metrics.EPPServedFallback) != float64(fellBack) {
		t.Errorf("%d requests fell back, %v counted", fellBack, testutil.ToFloat64(g.Metrics.EPPServedFallback))
	}
	poll.Until(t, "every request ended (the last one's stream closes after its answer)", func() bool {
		for _, w := range g.Registry.Snapshot().Workers {
			if w.InFlight() != 0 {
				return false
			}
		}
		return true
	})
	status := httptest.NewServer(g.Server.StatusHandler())
	defer status.Close()
	resp, err := http.Get(status.URL + "/status.json")
	if err != nil {
		t.Fatal(err)
	}
	var s struct {
		LastMinute struct {
			RPS float64 `json:"rps"`
		} `json:"last_minute"`
	}
	json.NewDecoder(resp.Body).Decode(&s)
	resp.Body.Close()
	if s.LastMinute.RPS <= 0 {
		t.Errorf("the picker's requests are not on the status page: %+v", s)
	}
}

// Bodies being assembled share the process-wide body budget with the HTTP listener's: past it
// a body is refused 503 overloaded, and a body handed back or an exchange ended gives its bytes
// back.
func TestEPPBodiesShareTheBudget(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL()), func(c *config.Config) { c.MaxPayloadSize, c.MaxBufferedBodyBytes = 1<<20, 2<<20 })
	take, give := g.Server.BodyBudget()
	client := extprocv3.NewExternalProcessorClient(conn)
	open := func(ctx context.Context) extprocv3.ExternalProcessor_ProcessClient {
		st, err := client.Process(ctx)
		if err != nil {
			t.Fatal(err)
		}
		st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
		return st
	}
	chunk := func(st extprocv3.ExternalProcessor_ProcessClient, n int) {
		st.Send(dataplane.RequestBody(bytes.Repeat([]byte(" "), n), false))
	}
	ctx1, cancel1 := context.WithCancel(context.Background())
	first := open(ctx1)
	chunk(first, 1000<<10) // held, the body not ended
	poll.Until(t, "the first body is held in the budget", func() bool {
		if take(1200 << 10) { // fits: the first chunk is not held yet
			give(1200 << 10)
			return false
		}
		return true
	})
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second) // no refusal: the test fails, not hangs
	defer cancel2()
	second := open(ctx2)
	chunk(second, 1000<<10)
	chunk(second, 10<<10) // its buffer grows past what is left
	m, err := second.Recv()
	if err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 503 || !strings.Contains(string(m.GetImmediateResponse().GetBody()), "overloaded") {
		t.Fatalf("past the budget: %v %v", m, err)
	}
	cancel1()
	poll.Until(t, "the budget given back", func() bool {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		st := rawStream(t, ctx, conn, `{"model":"m","prompt":"`+strings.Repeat("y", 900<<10)+`"}`)
		m, err := st.Recv()
		return err == nil && m.GetRequestHeaders() != nil
	})
}

// A filter that sends the body only after the headers were answered (STREAMED) gets its pick
// with the headers' answer, made without model or prompt, then each body chunk acknowledged.
func TestEPPHalfDuplexPicksFromHeaders(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	_, conn := startEPP(t, testConfig(a.URL()))
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer st.CloseSend()
	first := dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false)
	first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_STREAMED}
	st.Send(first)
	m, err := st.Recv()
	if err != nil || m.GetRequestHeaders() == nil || dataplane.Destination(m) != endpointOf(a.URL()) {
		t.Fatalf("the headers' answer: %v %v", m, err)
	}
	for i, eos := range []bool{false, true} {
		st.Send(dataplane.RequestBody([]byte([]string{`{"model":`, `"m"}`}[i]), eos))
		if m, err := st.Recv(); err != nil || m.GetRequestBody() == nil {
			t.Fatalf("body chunk (end %v): %v %v", eos, m, err)
		}
	}
}

// A data plane cannot hold the picker: past epp_max_streams a new stream ends at once with
// RESOURCE_EXHAUSTED; a stream whose request is not whole within body_timeout (an idle stream,
// headers and nothing else) is ended, and its place is free again. Both are counted.
func TestEPPStreamsAreBounded(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL()), func(c *config.Config) { c.EPPMaxStreams, c.BodyTimeout = 4, 400*time.Millisecond })
	client := extprocv3.NewExternalProcessorClient(conn)
	var idle []extprocv3.ExternalProcessor_ProcessClient
	for i := 0; i < 4; i++ {
		st, err := client.Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
		idle = append(idle, st)
	}
	poll.Until(t, "four exchanges served", func() bool { return testutil.ToFloat64(g.Metrics.EPPStreams) == 4 })
	extra, err := client.Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	extra.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
	if _, err := extra.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a fifth stream: %v, want RESOURCE_EXHAUSTED", err)
	}
	if n := testutil.ToFloat64(g.Metrics.EPPCut.WithLabelValues("max_streams")); n != 1 {
		t.Errorf("max_streams counted %v", n)
	}
	for i, st := range idle {
		if _, err := st.Recv(); status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("idle stream %d: %v, want DEADLINE_EXCEEDED after body_timeout", i, err)
		}
	}
	poll.Until(t, "the idle streams ended and counted", func() bool {
		return testutil.ToFloat64(g.Metrics.EPPStreams) == 0 && testutil.ToFloat64(g.Metrics.EPPCut.WithLabelValues("request_phase_timeout")) == 4
	})
	st := rawStream(t, context.Background(), conn, `{"model":"m","prompt":"x"}`)
	if eps := recvPick(t, st); len(eps) == 0 {
		t.Fatal("no pick once the places were free")
	}
}

// Bodies a data plane streams and abandons hold at most half of max_buffered_body_bytes: the
// HTTP listener's requests still find room, and the picker's share comes back when the
// abandoned exchanges are ended.
func TestEPPHoldsHalfTheBodyBudget(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL()), func(c *config.Config) {
		c.MaxPayloadSize, c.MaxBufferedBodyBytes, c.BodyTimeout = 3<<20, 4<<20, 1500*time.Millisecond
	})
	client := extprocv3.NewExternalProcessorClient(conn)
	abandon := func(n int) extprocv3.ExternalProcessor_ProcessClient {
		st, err := client.Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
		st.Send(dataplane.RequestBody(bytes.Repeat([]byte(" "), n), false))
		return st
	}
	first := abandon(1536 << 10)
	take, give := g.Server.BodyBudget()
	poll.Until(t, "the first body is held", func() bool {
		if take(3 << 20) {
			give(3 << 20)
			return false
		}
		return true
	})
	second := abandon(1024 << 10)
	if m, err := second.Recv(); err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 503 {
		t.Fatalf("a body past the picker's half: %v %v", m, err)
	}
	srv := httptest.NewServer(g.Server.Handler())
	defer srv.Close()
	big := `{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("z", 1<<20) + `"}`
	resp := post(t, srv.URL+"/v1/completions", big)
	if body := readAll(t, resp.Body); resp.StatusCode != 200 {
		t.Fatalf("the HTTP listener's request while the picker holds its half: %d %.200s", resp.StatusCode, body)
	}
	if _, err := first.Recv(); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("the abandoned body: %v", err)
	}
	st := rawStream(t, context.Background(), conn, `{"model":"m","prompt":"`+strings.Repeat("y", 1800<<10)+`"}`)
	if eps := recvPick(t, st); len(eps) == 0 {
		t.Fatal("no pick once the abandoned body was let go")
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

// Headers and fields only Baton sets never pass the picker: a client's X-Data-Parallel-Rank is
// removed by the pick's header mutation; in STREAMED mode (the body comes after the pick and
// cannot be edited) a body carrying an owned field is refused at its end, one without passes;
// in NONE mode (no body reaches the picker) an inference request with a body is refused.
func TestEPPOwnedFieldsNeverPass(t *testing.T) {
	t.Parallel()
	var got sync.Map
	engine := fakeEngine(t, "vllm", []string{"m"}, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		got.Store("rank", r.Header.Get("X-Data-Parallel-Rank"))
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	_, conn := startEPP(t, testConfig(engine.URL))
	_, srv := dataPlane(t, conn)
	resp := post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":1}`, "X-Data-Parallel-Rank", "7")
	if b := readAll(t, resp.Body); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if v, _ := got.Load("rank"); v != "" {
		t.Errorf("the engine got the client's X-Data-Parallel-Rank %q", v)
	}

	open := func(mode filterv3.ProcessingMode_BodySendMode, method, path string, eos bool) extprocv3.ExternalProcessor_ProcessClient {
		st, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		first := dataplane.RequestHeaders(method, "", path, nil, eos)
		first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode}
		st.Send(first)
		return st
	}
	for _, c := range []struct {
		name  string
		body  string
		owned string
	}{
		{"owned", `{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.9"}}`, "kv_transfer_params"},
		{"owned, another case", `{"model":"m","prompt":"x","PRIORITY":-100}`, "PRIORITY"},
		// A body the guard cannot parse but an engine's json.loads reads (a UTF-8 byte order
		// mark): refused as invalid, as every other mode refuses it.
		{"byte order mark", "\xef\xbb\xbf" + `{"model":"m","prompt":"x","priority":-100}`, "invalid_json"},
		{"clean", `{"model":"m","prompt":"x"}`, ""},
	} {
		st := open(filterv3.ProcessingMode_STREAMED, http.MethodPost, "/v1/completions", false)
		if m, err := st.Recv(); err != nil || m.GetRequestHeaders() == nil {
			t.Fatalf("%s: the headers' answer: %v %v", c.name, m, err)
		}
		half := len(c.body) / 2
		st.Send(dataplane.RequestBody([]byte(c.body[:half]), false))
		if m, err := st.Recv(); err != nil || m.GetRequestBody() == nil {
			t.Fatalf("%s: the first chunk: %v %v", c.name, m, err)
		}
		st.Send(dataplane.RequestBody([]byte(c.body[half:]), true))
		m, err := st.Recv()
		switch {
		case err != nil:
			t.Fatalf("%s: %v", c.name, err)
		case c.owned == "invalid_json" && (m.GetImmediateResponse().GetStatus().GetCode() != 400 || !strings.Contains(string(m.GetImmediateResponse().GetBody()), "invalid_json")):
			t.Errorf("%s: the last chunk's answer %v, want 400 invalid_json", c.name, m)
		case c.owned != "" && c.owned != "invalid_json" && (m.GetImmediateResponse().GetStatus().GetCode() != 400 || !strings.Contains(string(m.GetImmediateResponse().GetBody()), `"param":"`+c.owned+`"`)):
			t.Errorf("%s: the last chunk's answer %v, want 400 naming %s", c.name, m, c.owned)
		case c.owned == "" && m.GetRequestBody() == nil:
			t.Errorf("%s: the last chunk's answer %v, want it let through", c.name, m)
		}
		st.CloseSend()
	}
	st := open(filterv3.ProcessingMode_NONE, http.MethodPost, "/v1/chat/completions", false)
	if m, err := st.Recv(); err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 500 || !strings.Contains(string(m.GetImmediateResponse().GetBody()), "epp_body_unread") {
		t.Errorf("NONE mode, an inference request with a body: %v %v", m, err)
	}
	st = open(filterv3.ProcessingMode_NONE, http.MethodGet, "/v1/models", true)
	if m, err := st.Recv(); err != nil || m.GetRequestHeaders() == nil {
		t.Errorf("NONE mode, GET /v1/models: %v %v", m, err)
	}
}

// The body the picker hands back is written for its choice: a fallback that would read it
// otherwise (here: one worker takes Baton's priority field, the other is not marked to) is not
// listed; two alike are.
func TestEPPFallbacksTakeTheChoicesBody(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	b := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	cfg := testConfig()
	cfg.Workers = []config.Worker{{URL: a.URL(), ForwardPriority: true}, {URL: b.URL()}}
	_, conn := startEPP(t, cfg)
	for i := 0; i < 4; i++ {
		st := rawStream(t, context.Background(), conn, `{"model":"m","prompt":"x `+strconv.Itoa(i)+`"}`)
		if eps := recvPick(t, st); len(eps) != 1 {
			t.Errorf("a choice with a fallback that reads the body otherwise: %v", eps)
		}
		st.CloseSend()
	}
	alike := testConfig()
	alike.Workers = []config.Worker{{URL: a.URL(), ForwardPriority: true}, {URL: b.URL(), ForwardPriority: true}}
	_, conn2 := startEPP(t, alike)
	st := rawStream(t, context.Background(), conn2, `{"model":"m","prompt":"x"}`)
	if eps := recvPick(t, st); len(eps) != 2 {
		t.Errorf("two workers alike: %v, want the choice and a fallback", eps)
	}
}

// An immediate response ends the exchange: the picker does not hold the stream for a data plane
// that keeps it open (a refusal costs no place among the exchanges); a BUFFERED_PARTIAL body
// past the proxy's buffer is refused 413 rather than read as a whole body; a silent TCP
// connection holds its place among the connections for the 5 s handshake bound, not gRPC's 120 s.
func TestEPPRefusalsEndTheExchange(t *testing.T) {
	t.Parallel()
	a := startSim(t, sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	g, conn := startEPP(t, testConfig(a.URL()))
	client := extprocv3.NewExternalProcessorClient(conn)
	st, err := client.Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
	st.Send(dataplane.RequestBody([]byte("not json"), true))
	if m, err := st.Recv(); err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 400 {
		t.Fatalf("%v %v", m, err)
	}
	if m, err := st.Recv(); err != io.EOF { // the data plane has not closed its side
		t.Errorf("after the refusal: %v %v, want the stream ended", m, err)
	}
	poll.Until(t, "no exchange held", func() bool { return testutil.ToFloat64(g.Metrics.EPPStreams) == 0 })

	st, err = client.Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	first := dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false)
	first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_BUFFERED_PARTIAL}
	st.Send(first)
	if m, err := st.Recv(); err != nil || m.GetRequestHeaders() == nil {
		t.Fatalf("the headers' answer: %v %v", m, err)
	}
	st.Send(dataplane.RequestBody([]byte(`{"model":"m","prompt":"the first part of a`), false))
	if m, err := st.Recv(); err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 413 {
		t.Errorf("a partial buffer: %v %v", m, err)
	}

	cfg := g.Config
	cfg.Host, cfg.GRPCPort, cfg.GRPCHealthPort, cfg.EPPSecureServing, cfg.EPPMaxConnections = "127.0.0.1", 0, -1, true, 2
	el, err := g.listenEPP(cfg)
	if err != nil {
		t.Fatal(err)
	}
	el.serve()
	t.Cleanup(func() { el.stop(time.Now()) })
	for i := 0; i < 2; i++ { // silent: not even a TLS ClientHello
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
