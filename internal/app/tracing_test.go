package app

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/tracing"
)

// otlpReceiver is an in-process OTLP/HTTP collector: it decodes what Baton exports.
type otlpReceiver struct {
	mu    sync.Mutex
	spans []*tracepb.Span
	srv   *httptest.Server
}

func newOTLPReceiver(t *testing.T) *otlpReceiver {
	rc := &otlpReceiver{}
	rc.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var req collectortrace.ExportTraceServiceRequest
		if r.URL.Path != "/v1/traces" || proto.Unmarshal(body, &req) != nil {
			http.Error(w, "bad export", 400)
			return
		}
		rc.mu.Lock()
		for _, rs := range req.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				rc.spans = append(rc.spans, ss.Spans...)
			}
		}
		rc.mu.Unlock()
		out, _ := proto.Marshal(&collectortrace.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	t.Cleanup(rc.srv.Close)
	return rc
}

// capture turns tracing on towards the receiver, runs f, then flushes and turns it off, and
// returns the spans exported meanwhile.
func (rc *otlpReceiver) capture(t *testing.T, f func()) []*tracepb.Span {
	t.Helper()
	rc.mu.Lock()
	rc.spans = nil
	rc.mu.Unlock()
	stop, err := tracing.Setup(context.Background(), tracing.Config{Endpoint: rc.srv.URL, Ratio: 1})
	if err != nil || !tracing.Enabled() {
		t.Fatalf("tracing did not start: %v", err)
	}
	f()
	time.Sleep(50 * time.Millisecond) // spans ended by handlers finishing after the client read the answer
	if err := stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.spans
}

// headerRecorder sits in front of an engine and keeps the traceparent of each request by path.
type headerRecorder struct {
	mu     sync.Mutex
	parent map[string][]string
	srv    *httptest.Server
}

func recordHeaders(t *testing.T, target string) *headerRecorder {
	u, _ := url.Parse(target)
	h := &headerRecorder{parent: map[string][]string{}}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.FlushInterval = -1
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tp := r.Header.Get("Traceparent"); tp != "" {
			h.mu.Lock()
			h.parent[r.URL.Path] = append(h.parent[r.URL.Path], tp)
			h.mu.Unlock()
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(h.srv.Close)
	return h
}

func (h *headerRecorder) traceparents(path string) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.parent[path]...)
}

func attr(s *tracepb.Span, key string) string {
	for _, a := range s.Attributes {
		if a.Key == key {
			v := a.Value
			switch {
			case v.GetStringValue() != "":
				return v.GetStringValue()
			default:
				return fmt.Sprint(v.GetIntValue())
			}
		}
	}
	return ""
}

func byName(spans []*tracepb.Span, name string) []*tracepb.Span {
	var out []*tracepb.Span
	for _, s := range spans {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

func one(t *testing.T, spans []*tracepb.Span, name string) *tracepb.Span {
	t.Helper()
	got := byName(spans, name)
	if len(got) != 1 {
		var names []string
		for _, s := range spans {
			names = append(names, s.Name)
		}
		t.Fatalf("%d spans named %q; spans: %v", len(got), name, names)
	}
	return got[0]
}

func childOf(t *testing.T, child, parent *tracepb.Span) {
	t.Helper()
	if hex.EncodeToString(child.ParentSpanId) != hex.EncodeToString(parent.SpanId) || hex.EncodeToString(child.TraceId) != hex.EncodeToString(parent.TraceId) {
		t.Errorf("span %q is not a child of %q", child.Name, parent.Name)
	}
}

// traceparentOf is the W3C traceparent naming span s.
func traceparentOf(s *tracepb.Span) string {
	return "00-" + hex.EncodeToString(s.TraceId) + "-" + hex.EncodeToString(s.SpanId) + "-01"
}

// The span trees Baton exports over OTLP: a regular request (server, select, upstream; the
// engine's traceparent is the upstream span, under the client's trace), a vLLM PD request
// (prefill then decode, the handoff on the server span, the decode's traceparent its span), an
// SGLang PD request (both legs at once), and a retried request (a retry event, one upstream span
// per attempt).
func TestTracingSpanTrees(t *testing.T) {
	rc := newOTLPReceiver(t)

	t.Run("regular", func(t *testing.T) {
		e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
		rec := recordHeaders(t, e.URL())
		_, gw := startGateway(t, testConfig(rec.srv.URL))
		client := "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
		spans := rc.capture(t, func() {
			resp := post(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":3}`, pdModel), "Traceparent", client)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			_, _ = io.ReadAll(resp.Body)
		})
		server := one(t, spans, "POST /v1/completions")
		if hex.EncodeToString(server.TraceId) != "0af7651916cd43dd8448eb211c80319c" || hex.EncodeToString(server.ParentSpanId) != "b7ad6b7169203331" || server.Kind != tracepb.Span_SPAN_KIND_SERVER {
			t.Errorf("the server span does not continue the client's trace: %x parent %x kind %v", server.TraceId, server.ParentSpanId, server.Kind)
		}
		if attr(server, "gen_ai.request.model") != pdModel || attr(server, "http.response.status_code") != "200" || attr(server, "baton.worker") != rec.srv.URL {
			t.Errorf("server span attributes: %v", server.Attributes)
		}
		sel := one(t, spans, "select")
		childOf(t, sel, server)
		if attr(sel, "baton.select.0.policy") != "round_robin" || attr(sel, "baton.select.0.worker") != rec.srv.URL {
			t.Errorf("select span attributes: %v", sel.Attributes)
		}
		up := one(t, spans, "upstream")
		childOf(t, up, server)
		if up.Kind != tracepb.Span_SPAN_KIND_CLIENT || attr(up, "http.response.status_code") != "200" || attr(up, "baton.attempt") != "1" {
			t.Errorf("upstream span: kind %v attributes %v", up.Kind, up.Attributes)
		}
		if got := rec.traceparents("/v1/completions"); len(got) != 1 || got[0] != traceparentOf(up) {
			t.Errorf("the engine got traceparent %v, want its leg's span %s", got, traceparentOf(up))
		}
	})

	t.Run("vllm_pd", func(t *testing.T) {
		p := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl, EngineID: "engine-p"})
		d := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RoleDecode, KVConnector: sim.ConnectorNixl})
		drec := recordHeaders(t, d.URL())
		cfg := config.Default()
		cfg.PDDisaggregation = true
		cfg.Workers = []config.Worker{{URL: p.URL(), Role: config.RolePrefill, KVConnector: "NixlConnector"}, {URL: drec.srv.URL, Role: config.RoleDecode}}
		_, gw := startGateway(t, cfg)
		spans := rc.capture(t, func() {
			resp := post(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"hello there","max_tokens":4}`, pdModel))
			if resp.StatusCode != 200 || resp.Header.Get("X-Baton-Kv-Handoff") != "nixl" {
				t.Fatalf("status %d handoff %q", resp.StatusCode, resp.Header.Get("X-Baton-Kv-Handoff"))
			}
			_, _ = io.ReadAll(resp.Body)
		})
		server := one(t, spans, "POST /v1/completions")
		pre, dec := one(t, spans, "prefill"), one(t, spans, "decode")
		childOf(t, pre, server)
		childOf(t, dec, server)
		if pre.EndTimeUnixNano > dec.StartTimeUnixNano {
			t.Errorf("the vLLM prefill span ends after the decode span starts")
		}
		if attr(server, "baton.pd.handoff") != "nixl" || attr(server, "baton.mode") != "pd_vllm" || attr(pre, "baton.kv_connector") != "NixlConnector" {
			t.Errorf("PD attributes: server %v prefill %v", server.Attributes, pre.Attributes)
		}
		if got := drec.traceparents("/v1/completions"); len(got) != 1 || got[0] != traceparentOf(dec) {
			t.Errorf("the decode engine got traceparent %v, want the decode span %s", got, traceparentOf(dec))
		}
	})

	t.Run("sglang_pd", func(t *testing.T) {
		_, _, _, gw := sglangPD(t, sim.Config{DecodePerToken: time.Millisecond}, sim.Config{DecodePerToken: time.Millisecond})
		spans := rc.capture(t, func() {
			resp := post(t, gw+"/generate", `{"text":"hello","model":"m","sampling_params":{"max_new_tokens":8}}`)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
			_, _ = io.ReadAll(resp.Body)
		})
		server := one(t, spans, "POST /generate")
		pre, dec := one(t, spans, "prefill"), one(t, spans, "decode")
		childOf(t, pre, server)
		childOf(t, dec, server)
		if !(pre.StartTimeUnixNano < dec.EndTimeUnixNano && dec.StartTimeUnixNano < pre.EndTimeUnixNano) {
			t.Errorf("the SGLang legs' spans do not overlap: prefill %d-%d, decode %d-%d", pre.StartTimeUnixNano, pre.EndTimeUnixNano, dec.StartTimeUnixNano, dec.EndTimeUnixNano)
		}
		if attr(server, "baton.pd.handoff") != "bootstrap" || attr(server, "baton.mode") != "pd_sglang" {
			t.Errorf("server span attributes: %v", server.Attributes)
		}
	})

	t.Run("retried", func(t *testing.T) {
		bad := simEngine(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{Status: 503}})
		good := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
		cfg := testConfig(bad.URL(), good.URL())
		cfg.HealthCheck.Disable = true
		_, gw := startGateway(t, cfg)
		var spans []*tracepb.Span
		for range 4 { // round robin: the first try lands on the failing engine within two requests
			spans = rc.capture(t, func() {
				resp := post(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":1}`, pdModel))
				_, _ = io.ReadAll(resp.Body)
			})
			if len(byName(spans, "upstream")) == 2 {
				break
			}
		}
		server := one(t, spans, "POST /v1/completions")
		ups := byName(spans, "upstream")
		if len(ups) != 2 {
			t.Fatalf("%d upstream spans, want 2", len(ups))
		}
		attempts := map[string]string{}
		for _, u := range ups {
			childOf(t, u, server)
			attempts[attr(u, "baton.attempt")] = attr(u, "baton.worker")
		}
		if attempts["1"] != bad.URL() || attempts["2"] != good.URL() {
			t.Errorf("attempts: %v", attempts)
		}
		var retry bool
		for _, e := range server.Events {
			retry = retry || (e.Name == "retry" && strings.Contains(fmt.Sprint(e.Attributes), "status_503"))
		}
		if !retry || attr(server, "baton.attempts") != "2" {
			t.Errorf("no retry event on the server span: events %v attempts %s", server.Events, attr(server, "baton.attempts"))
		}
	})
}

// grpcReceiver is an in-process OTLP/gRPC collector.
type grpcReceiver struct {
	collectortrace.UnimplementedTraceServiceServer
	mu    sync.Mutex
	spans []*tracepb.Span
}

func (g *grpcReceiver) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, rs := range req.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			g.spans = append(g.spans, ss.Spans...)
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

// Tracing configured only by the standard environment (OTEL_EXPORTER_OTLP_ENDPOINT with
// OTEL_EXPORTER_OTLP_PROTOCOL=grpc) exports over OTLP/gRPC.
func TestTracingOverGRPCFromEnvironment(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	rcv := &grpcReceiver{}
	gs := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(gs, rcv)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+ln.Addr().String())
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	_, gw := startGateway(t, testConfig(e.URL()))
	stop, err := tracing.Setup(context.Background(), tracing.Config{Ratio: 1})
	if err != nil || !tracing.Enabled() {
		t.Fatalf("tracing from the environment did not start: %v", err)
	}
	resp := post(t, gw.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":2}`, pdModel))
	_, _ = io.ReadAll(resp.Body)
	time.Sleep(50 * time.Millisecond)
	if err := stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	rcv.mu.Lock()
	defer rcv.mu.Unlock()
	if len(byName(rcv.spans, "POST /v1/completions")) != 1 || len(byName(rcv.spans, "upstream")) != 1 {
		t.Errorf("spans over gRPC: %d", len(rcv.spans))
	}
}
