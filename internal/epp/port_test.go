package epp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc"
	grpccodes "google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/epp/dataplane"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/worker"
)

// A streamed chat completion goes through the data plane to the endpoint the picker named:
// header and metadata agree and list the choice then a fallback; the stream arrives whole; the
// request ends in the gateway's books once the data plane closed the stream, with the usage
// read from the relayed stream and its first byte, and leaves no count in flight.
func TestPortStreamsThroughTheDataPlane(t *testing.T) {
	t.Parallel()
	a, b := simulated(t), simulated(t)
	p := startPicker(t, []config.Worker{a, b})
	dp, front := p.dataPlane(t)
	resp, body := ask(t, front+"/v1/chat/completions", `{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":8,"messages":[{"role":"user","content":"hello there"}]}`)
	if resp.StatusCode != 200 || !strings.Contains(body, "data: [DONE]") {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	ex := dp.Last()
	eps := strings.Split(ex.Header, ",")
	if ex.Header != ex.Metadata || len(eps) != 2 || eps[0] == eps[1] || ex.Served != eps[0] {
		t.Fatalf("pick %+v", ex)
	}
	for _, ep := range eps {
		if ep != endpointOf(a.URL) && ep != endpointOf(b.URL) {
			t.Fatalf("endpoint %q is no worker's", ep)
		}
	}
	poll.Until(t, "the request in the books, with the 8 completion tokens of the relayed stream's usage", func() bool {
		done := p.books.endedWith(200)
		return len(done) == 1 && done[0].Route == "POST /v1/chat/completions" && done[0].Usage.Completion == 8 && done[0].UsageKnown
	})
	if rec := p.books.endedWith(200)[0]; rec.FirstByte.IsZero() || rec.Model != "m" || rec.Worker != a.URL && rec.Worker != b.URL {
		t.Errorf("the record: first byte %v, model %q, worker %q", rec.FirstByte, rec.Model, rec.Worker)
	}
	if n := testutil.ToFloat64(p.metrics.EPPDecisions.WithLabelValues("picked")); n != 1 {
		t.Errorf("decisions: %v", n)
	}
	poll.Until(t, "nothing in flight after the response", p.idle)
}

// A body larger than a gRPC message (4 MiB by default) is assembled from the proxy's chunks,
// read, and handed back byte for byte — unknown keys, big integers and unicode included — in
// chunks a message holds, in full duplex and buffered modes.
func TestPortHandsALargeBodyBackUnchanged(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []byte
	up := fake(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = b
		mu.Unlock()
		io.WriteString(w, `{"choices":[]}`)
	})
	// Few streams: each may take a 6 MiB body in one message (BUFFERED).
	p := startPicker(t, []config.Worker{up}, func(c *config.Config) { c.EPPMaxStreams = 4 })
	body := `{"model":"m","x_unknown":{"n":12345678901234567890,"s":"héllo ✓ \u00e9"},"messages":[{"role":"user","content":"` + strings.Repeat("y", 6<<20) + `"}]}`
	for _, buffered := range []bool{false, true} {
		t.Run(fmt.Sprintf("buffered=%v", buffered), func(t *testing.T) {
			_, front := p.dataPlane(t, func(dp *dataplane.Proxy) { dp.Buffered, dp.ChunkSize = buffered, 64<<10 })
			if resp, b := ask(t, front+"/v1/chat/completions", body); resp.StatusCode != 200 {
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

// The subset hint: only its endpoints are picked (an address without a port matches the
// workers' IP, as the reference picker does); an empty subset, or one with no eligible
// endpoint, is an immediate 503.
func TestPortSubsetHint(t *testing.T) {
	t.Parallel()
	a, b := simulated(t), simulated(t)
	p := startPicker(t, []config.Worker{a, b})
	var subset []string
	dp, front := p.dataPlane(t, func(dp *dataplane.Proxy) { dp.Subset = func(*http.Request) []string { return subset } })
	req := `{"model":"m","max_tokens":2,"prompt":"hi"}`
	for range 4 {
		subset = []string{endpointOf(b.URL)}
		resp, _ := ask(t, front+"/v1/completions", req)
		if ex := dp.Last(); resp.StatusCode != 200 || ex.Header != endpointOf(b.URL) {
			t.Fatalf("subset of b: %d %+v", resp.StatusCode, ex)
		}
	}
	for _, sub := range [][]string{{"127.0.0.1:1"}, {"127.0.0.1"}} {
		subset = sub
		resp, _ := ask(t, front+"/v1/completions", req)
		if ex := dp.Last(); resp.StatusCode != 200 || ex.Header == "" {
			t.Errorf("subset %v (the workers' IP): %d %+v", sub, resp.StatusCode, ex)
		}
	}
	for name, sub := range map[string][]string{"empty": {}, "ineligible": {"10.255.0.1:9", "not-an-endpoint"}} {
		subset = sub
		resp, body := ask(t, front+"/v1/completions", req)
		wantRefused(t, resp, body, 503, "no_endpoint_in_subset")
		if ex := dp.Last(); ex.Immediate != 503 || len(ex.Tried) != 0 {
			t.Errorf("%s subset: %+v", name, ex)
		}
	}
}

// A batch request is shed (429, Retry-After) when every worker that could serve it queues past
// the threshold; a default-class request still goes through.
func TestPortShedsBatchUnderLoad(t *testing.T) {
	t.Parallel()
	up := simulated(t)
	p := startPicker(t, []config.Worker{up})
	p.worker(up.URL).SetEngineLoad(worker.EngineLoad{Waiting: 9, Running: 4, HasWaiting: true, HasRunning: true,
		At: time.Now(), Until: time.Now().Add(time.Hour)})
	_, front := p.dataPlane(t)
	resp, body := ask(t, front+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Baton-Priority", "batch")
	wantRefused(t, resp, body, 429, "request_shed")
	if resp.Header.Get("Retry-After") == "" {
		t.Error("no Retry-After")
	}
	if resp, _ := ask(t, front+"/v1/completions", `{"model":"m","prompt":"x"}`); resp.StatusCode != 200 {
		t.Fatalf("default class: %d", resp.StatusCode)
	}
}

// No available endpoint: an immediate 503; bad requests: the OpenAI envelope with the right
// status, nothing picked; each refusal counted by its code.
func TestPortRefusals(t *testing.T) {
	t.Parallel()
	a := simulated(t)
	p := startPicker(t, []config.Worker{a}, func(c *config.Config) { c.MaxPayloadSize = 1 << 20; c.MaxBufferedBodyBytes = 4 << 20 })
	_, front := p.dataPlane(t)
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
		resp, body := ask(t, front+"/v1/completions", tc.body)
		wantRefused(t, resp, body, tc.status, tc.code)
	}
	resp, body := ask(t, front+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Baton-Priority", "urgent!")
	wantRefused(t, resp, body, 400, "invalid_priority")
	p.worker(a.URL).SetCordoned(true)
	resp, body = ask(t, front+"/v1/completions", `{"model":"m","prompt":"x"}`)
	wantRefused(t, resp, body, 503, "no_available_workers")
	if n := testutil.ToFloat64(p.metrics.EPPDecisions.WithLabelValues("no_available_workers")); n != 1 {
		t.Errorf("refusals counted: %v", n)
	}
	if n := testutil.ToFloat64(p.metrics.EPPDecisions.WithLabelValues("invalid_json")); n != 2 {
		t.Errorf("invalid_json counted: %v", n)
	}
}

// The served endpoint read back: when the proxy reports a fallback served, the request's count
// in flight moves to that worker, and the move is counted; the end of the response ends it. A
// proxy that cancels the stream mid-response ends the request too (499), nothing left in flight.
func TestPortServedEndpointAndCancel(t *testing.T) {
	t.Parallel()
	p := startPicker(t, []config.Worker{simulated(t), simulated(t)})
	byEndpoint := map[string]*worker.Worker{}
	for _, w := range p.reg.Snapshot().Workers {
		byEndpoint[w.Endpoint] = w
	}
	st := requestStream(t, context.Background(), p.client(), `{"model":"m","prompt":"x"}`)
	eps := destinations(t, st)
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
	if n := testutil.ToFloat64(p.metrics.EPPServedFallback); n != 1 {
		t.Errorf("served by a fallback: %v", n)
	}
	st.Send(dataplane.ResponseBody([]byte(`{"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}`), true))
	if m, err := st.Recv(); err != nil || !strings.Contains(string(m.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse().GetBody()), "completion_tokens") {
		t.Fatalf("the response body was not handed back: %v %v", m, err)
	}
	st.CloseSend()
	st.Recv()
	poll.Until(t, "the request ended, served by the fallback", func() bool {
		done := p.books.endedWith(200)
		return byEndpoint[eps[1]].InFlight() == 0 && len(done) == 1 && done[0].Usage.Completion == 5
	})

	ctx, cancel := context.WithCancel(context.Background())
	st = requestStream(t, ctx, p.client(), `{"model":"m","prompt":"x"}`)
	eps = destinations(t, st)
	cancel()
	poll.Until(t, "the cancelled request ended", func() bool {
		return byEndpoint[eps[0]].InFlight() == 0 && len(p.books.endedWith(499)) == 1
	})
	poll.Until(t, "nothing in flight", p.idle)
}

// rawCodec sends bytes as they are: a malformed message.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error)      { return v.([]byte), nil }
func (rawCodec) Unmarshal(data []byte, v any) error { *(v.(*[]byte)) = data; return nil }
func (rawCodec) Name() string                       { return "proto" }

// Malformed messages and messages out of order end their stream with an error; the picker
// serves the next stream as before.
func TestPortBadProtocolInput(t *testing.T) {
	t.Parallel()
	a := simulated(t)
	p := startPicker(t, []config.Worker{a})
	desc := &grpc.StreamDesc{StreamName: "Process", ServerStreams: true, ClientStreams: true}
	raw, err := p.conn.NewStream(context.Background(), desc, "/envoy.service.ext_proc.v3.ExternalProcessor/Process", grpc.ForceCodec(rawCodec{}))
	if err != nil {
		t.Fatal(err)
	}
	raw.SendMsg([]byte{0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01})
	var out []byte
	if err := raw.RecvMsg(&out); status.Code(err) == grpccodes.OK {
		t.Fatalf("a malformed message answered: %v", err)
	}
	st, err := p.client().Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	st.Send(dataplane.RequestBody([]byte("{}"), true))
	if _, err := st.Recv(); status.Code(err) != grpccodes.InvalidArgument {
		t.Fatalf("a body before headers: %v", err)
	}
	st, _ = p.client().Process(context.Background())
	st.Send(dataplane.ResponseHeaders(http.StatusOK, nil, "", false))
	if _, err := st.Recv(); status.Code(err) != grpccodes.InvalidArgument {
		t.Fatalf("response headers before the request: %v", err)
	}
	if eps := destinations(t, requestStream(t, context.Background(), p.client(), `{"model":"m","prompt":"x"}`)); eps[0] != endpointOf(a.URL) {
		t.Fatalf("after bad streams: %v", eps)
	}
}

// An alias, and the default model of a request that names none, are renamed to the workers'
// model in the body handed back (its length set anew). A client's own x-prefiller-host-port
// never reaches an engine: the picker removes it when it names no prefill.
func TestPortRenamesAnAlias(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got map[string]any
	var length, prefiller string
	up := fake(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		json.NewDecoder(r.Body).Decode(&got)
		length, prefiller = r.Header.Get("Content-Length"), r.Header.Get(epp.HeaderPrefiller)
		io.WriteString(w, `{"choices":[]}`)
	})
	up.Models = []string{"big-model"}
	p := startPicker(t, []config.Worker{up}, func(c *config.Config) {
		c.Models = map[string]config.ModelConfig{"small": {Serve: "big-model"}}
		c.DefaultModel = "small"
	})
	_, front := p.dataPlane(t)
	for _, body := range []string{`{"model":"small","prompt":"x"}`, `{"prompt":"x"}`} {
		if resp, b := ask(t, front+"/v1/completions", body, epp.HeaderPrefiller, "10.0.0.9:8000"); resp.StatusCode != 200 {
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

// Time and size bound what a proxy may send: an exchange past the request deadline (plus a
// grace) is ended, the request with it; too many header fields are refused 431, the refusal the
// only answer in every body mode.
func TestPortBoundsTheExchange(t *testing.T) {
	t.Parallel()
	a := simulated(t)
	p := startPicker(t, []config.Worker{a}, func(c *config.Config) { c.RequestTimeout = 300 * time.Millisecond })
	st := requestStream(t, context.Background(), p.client(), `{"model":"m","prompt":"x"}`)
	destinations(t, st) // then the proxy goes silent
	w := p.worker(a.URL)
	if w.InFlight() != 1 {
		t.Fatalf("in flight: %d", w.InFlight())
	}
	if _, err := st.Recv(); status.Code(err) != grpccodes.DeadlineExceeded {
		t.Fatalf("a silent exchange: %v", err)
	}
	poll.Until(t, "the request ended", func() bool { return w.InFlight() == 0 })
	if n := testutil.ToFloat64(p.metrics.EPPCut.WithLabelValues("max_duration")); n != 1 {
		t.Errorf("max_duration counted %v", n)
	}

	flood := http.Header{}
	for i := range 300 {
		flood.Set(fmt.Sprintf("x-h%d", i), "v")
	}
	for _, mode := range []filterv3.ProcessingMode_BodySendMode{filterv3.ProcessingMode_FULL_DUPLEX_STREAMED, filterv3.ProcessingMode_BUFFERED} {
		pst, err := p.client().Process(context.Background())
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
		if m, err := pst.Recv(); err != io.EOF {
			t.Errorf("%s: after the refusal: %v %v", mode, m, err)
		}
	}
}

// The data plane goes down the list: when the chosen endpoint refuses connections (its engine
// gone before Baton noticed), the next one serves, the proxy says so, and Baton moves the
// request there and counts it.
func TestPortFallbackDownTheList(t *testing.T) {
	t.Parallel()
	a, b := simulated(t), simulated(t)
	gone := httpClosed(t)
	a.URL = gone // Baton still holds it available: nothing asks it before the picks
	p := startPicker(t, []config.Worker{a, b})
	dp, front := p.dataPlane(t)
	var fellBack int
	for range 4 {
		resp, body := ask(t, front+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":2}`)
		ex := dp.Last()
		if resp.StatusCode != 200 || ex.Served != endpointOf(b.URL) {
			t.Fatalf("%d %s (%+v)", resp.StatusCode, body, ex)
		}
		if len(ex.Tried) == 2 {
			fellBack++
		}
	}
	if fellBack == 0 || testutil.ToFloat64(p.metrics.EPPServedFallback) != float64(fellBack) {
		t.Errorf("%d requests fell back, %v counted", fellBack, testutil.ToFloat64(p.metrics.EPPServedFallback))
	}
	poll.Until(t, "every request ended (the last one's stream closes after its answer)", p.idle)
	if n := len(p.books.endedWith(200)); n != 4 {
		t.Errorf("%d requests in the books, want 4", n)
	}
}

// Bodies being assembled share the process-wide body budget with the HTTP listener's: past it
// a body is refused 503 overloaded, and a body handed back or an exchange ended gives its bytes
// back.
func TestPortBodiesShareTheBudget(t *testing.T) {
	t.Parallel()
	p := startPicker(t, []config.Worker{simulated(t)}, func(c *config.Config) { c.MaxPayloadSize, c.MaxBufferedBodyBytes = 1<<20, 2<<20 })
	take, give := p.budget.hand()
	opened := func(ctx context.Context) extprocv3.ExternalProcessor_ProcessClient {
		st, err := p.client().Process(ctx)
		if err != nil {
			t.Fatal(err)
		}
		st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
		return st
	}
	chunk := func(st extprocv3.ExternalProcessor_ProcessClient, n int) { sendSpaces(st, n) }
	ctx1, cancel1 := context.WithCancel(context.Background())
	first := opened(ctx1)
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
	second := opened(ctx2)
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
		st := requestStream(t, ctx, p.client(), `{"model":"m","prompt":"`+strings.Repeat("y", 900<<10)+`"}`)
		m, err := st.Recv()
		return err == nil && m.GetRequestHeaders() != nil
	})
}

// gRPC holds a whole message before the picker sees it, so a message is bounded by a stream's
// share of the picker's half of the body budget: many streams at once each sending a body in
// one message past it are ended RESOURCE_EXHAUSTED with nothing of them held; bodies streamed
// in chunks are charged before they are held, and never hold more than the picker's half.
func TestPortMessagesStayWithinTheBudget(t *testing.T) {
	t.Parallel()
	p := startPicker(t, []config.Worker{simulated(t)}, func(c *config.Config) {
		c.MaxPayloadSize, c.MaxBufferedBodyBytes, c.EPPMaxStreams = 4<<20, 16<<20, 64
	})
	const streams = 40
	big := `{"model":"m","prompt":"` + strings.Repeat("y", 1<<20) + `"}`
	var wg sync.WaitGroup
	got := make([]grpccodes.Code, streams)
	for i := range streams {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a hang fails, not hangs
			defer cancel()
			st, err := p.client().Process(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
			st.Send(dataplane.RequestBody([]byte(big), true))
			m, err := st.Recv()
			got[i] = status.Code(err)
			if err == nil {
				t.Errorf("a body of 1 MiB in one message: answered with a %T", m.Response)
			}
		})
	}
	wg.Wait()
	for i, c := range got {
		if c != grpccodes.ResourceExhausted {
			t.Errorf("stream %d: %v, want ResourceExhausted", i, c)
		}
	}
	if n := p.budget.peak.Load(); n != 0 {
		t.Errorf("%d bytes of bodies past the message bound were held", n)
	}

	// Bodies of 1 MiB in 64 KiB chunks, 40 at once: 40 MiB against the picker's 8 MiB.
	picked := 0
	var mu sync.Mutex
	for range streams {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			st, err := p.client().Process(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
			for rest := []byte(big); len(rest) > 0; { // a refused stream ends: its sends fail
				n := min(len(rest), 64<<10)
				st.Send(dataplane.RequestBody(rest[:n], n == len(rest)))
				rest = rest[n:]
			}
			m, err := st.Recv()
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil && m.GetRequestHeaders() != nil:
				picked++
			case err == nil && m.GetImmediateResponse().GetStatus().GetCode() == 503: // no room left
			default:
				t.Errorf("a chunked body: %v %v", m, err)
			}
		})
	}
	wg.Wait()
	if picked == 0 {
		t.Error("no chunked body was picked")
	}
	if peak := p.budget.peak.Load(); peak > 8<<20 {
		t.Errorf("the picker held %d bytes of bodies at once, above its half of the budget (%d)", peak, 8<<20)
	}
}

// The message bound is a stream's share of the picker's half of max_buffered_body_bytes, at
// most a body of max_payload_size, at least 128 KiB; where the least rules, fewer streams are
// served at once, so that the messages in flight never pass that half.
func TestMessageBound(t *testing.T) {
	for _, c := range []struct {
		payload, budget    int64
		streams            int
		wantSize, wantMany int
	}{
		{32 << 20, 256 << 20, 1024, 128 << 10, 1024}, // the defaults
		{32 << 20, 256 << 20, 2, 32<<20 + 64<<10, 2}, // few streams: a whole body in one message
		{4 << 20, 16 << 20, 64, 128 << 10, 64},       // 8 MiB over 64
		{1 << 20, 2 << 20, 1024, 128 << 10, 8},       // a small budget: fewer streams
		{64 << 10, 1 << 40, 2, 64<<10 + 64<<10, 2},   // never past a body of max_payload_size
	} {
		cfg := config.Default()
		cfg.MaxPayloadSize, cfg.MaxBufferedBodyBytes, cfg.EPPMaxStreams = c.payload, c.budget, c.streams
		size, many := epp.MessageBound(cfg)
		if size != c.wantSize || many != c.wantMany {
			t.Errorf("payload %d, budget %d, %d streams: %d bytes, %d streams; want %d, %d", c.payload, c.budget, c.streams, size, many, c.wantSize, c.wantMany)
		}
		if int64(size)*int64(many) > c.budget/2 {
			t.Errorf("payload %d, budget %d: %d streams of %d bytes pass half the budget", c.payload, c.budget, many, size)
		}
	}
}

// Bodies a data plane streams and abandons hold at most half of max_buffered_body_bytes: the
// HTTP listener's bodies still find room in the budget, and the picker's share comes back when
// the abandoned exchanges are ended.
func TestPortHoldsHalfTheBodyBudget(t *testing.T) {
	t.Parallel()
	p := startPicker(t, []config.Worker{simulated(t)}, func(c *config.Config) {
		c.MaxPayloadSize, c.MaxBufferedBodyBytes, c.BodyTimeout = 3<<20, 4<<20, 1500*time.Millisecond
	})
	abandon := func(n int) extprocv3.ExternalProcessor_ProcessClient {
		st, err := p.client().Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
		sendSpaces(st, n)
		return st
	}
	first := abandon(1536 << 10)
	take, give := p.budget.hand()
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
	// What the picker holds is at most half: an HTTP listener's body of 2 MiB still fits.
	if !take(2 << 20) {
		t.Fatalf("the HTTP listener's body found no room while the picker holds %d bytes", p.budget.held.Load())
	}
	give(2 << 20)
	if _, err := first.Recv(); status.Code(err) != grpccodes.DeadlineExceeded {
		t.Fatalf("the abandoned body: %v", err)
	}
	st := requestStream(t, context.Background(), p.client(), `{"model":"m","prompt":"`+strings.Repeat("y", 1800<<10)+`"}`)
	if eps := destinations(t, st); len(eps) == 0 {
		t.Fatal("no pick once the abandoned body was let go")
	}
}

// A filter that sends the body only after the headers were answered (STREAMED) gets its pick
// with the headers' answer, made without model or prompt, then each body chunk acknowledged.
func TestPortHalfDuplexPicksFromHeaders(t *testing.T) {
	t.Parallel()
	a := simulated(t)
	p := startPicker(t, []config.Worker{a})
	st, err := p.client().Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer st.CloseSend()
	first := dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false)
	first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_STREAMED}
	st.Send(first)
	m, err := st.Recv()
	if err != nil || m.GetRequestHeaders() == nil || dataplane.Destination(m) != endpointOf(a.URL) {
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
func TestPortStreamsAreBounded(t *testing.T) {
	t.Parallel()
	p := startPicker(t, []config.Worker{simulated(t)}, func(c *config.Config) { c.EPPMaxStreams, c.BodyTimeout = 4, 400*time.Millisecond })
	var idle []extprocv3.ExternalProcessor_ProcessClient
	for range 4 {
		st, err := p.client().Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
		idle = append(idle, st)
	}
	poll.Until(t, "four exchanges served", func() bool { return testutil.ToFloat64(p.metrics.EPPStreams) == 4 })
	extra, err := p.client().Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	extra.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
	if _, err := extra.Recv(); status.Code(err) != grpccodes.ResourceExhausted {
		t.Fatalf("a fifth stream: %v, want RESOURCE_EXHAUSTED", err)
	}
	if n := testutil.ToFloat64(p.metrics.EPPCut.WithLabelValues("max_streams")); n != 1 {
		t.Errorf("max_streams counted %v", n)
	}
	for i, st := range idle {
		if _, err := st.Recv(); status.Code(err) != grpccodes.DeadlineExceeded {
			t.Errorf("idle stream %d: %v, want DEADLINE_EXCEEDED after body_timeout", i, err)
		}
	}
	poll.Until(t, "the idle streams ended and counted", func() bool {
		return testutil.ToFloat64(p.metrics.EPPStreams) == 0 && testutil.ToFloat64(p.metrics.EPPCut.WithLabelValues("request_phase_timeout")) == 4
	})
	if eps := destinations(t, requestStream(t, context.Background(), p.client(), `{"model":"m","prompt":"x"}`)); len(eps) == 0 {
		t.Fatal("no pick once the places were free")
	}
}

// Headers and fields only Baton sets never pass the picker: a client's X-Data-Parallel-Rank is
// removed by the pick's header mutation; in STREAMED mode (the body comes after the pick and
// cannot be edited) a body carrying an owned field is refused at its end, one without passes;
// in NONE mode (no body reaches the picker) an inference request with a body is refused.
func TestPortOwnedFieldsNeverPass(t *testing.T) {
	t.Parallel()
	var got sync.Map
	up := fake(t, func(w http.ResponseWriter, r *http.Request) {
		io.ReadAll(r.Body)
		got.Store("rank", r.Header.Get("X-Data-Parallel-Rank"))
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"choices":[{"index":0,"text":"ok","finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	})
	p := startPicker(t, []config.Worker{up})
	_, front := p.dataPlane(t)
	if resp, b := ask(t, front+"/v1/completions", `{"model":"m","prompt":"x","max_tokens":1}`, "X-Data-Parallel-Rank", "7"); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	if v, _ := got.Load("rank"); v != "" {
		t.Errorf("the engine got the client's X-Data-Parallel-Rank %q", v)
	}
	opened := func(mode filterv3.ProcessingMode_BodySendMode, method, path string, eos bool) extprocv3.ExternalProcessor_ProcessClient {
		st, err := p.client().Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		first := dataplane.RequestHeaders(method, "", path, nil, eos)
		first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode}
		st.Send(first)
		return st
	}
	for _, c := range []struct{ name, body, owned string }{
		{"owned", `{"model":"m","prompt":"x","kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.0.0.9"}}`, "kv_transfer_params"},
		{"owned, another case", `{"model":"m","prompt":"x","PRIORITY":-100}`, "PRIORITY"},
		// A body the guard cannot parse but an engine's json.loads reads (a UTF-8 byte order
		// mark): refused as invalid, as every other mode refuses it.
		{"byte order mark", "\xef\xbb\xbf" + `{"model":"m","prompt":"x","priority":-100}`, "invalid_json"},
		{"clean", `{"model":"m","prompt":"x"}`, ""},
	} {
		st := opened(filterv3.ProcessingMode_STREAMED, http.MethodPost, "/v1/completions", false)
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
		refusal := m.GetImmediateResponse()
		switch {
		case err != nil:
			t.Fatalf("%s: %v", c.name, err)
		case c.owned == "invalid_json" && (refusal.GetStatus().GetCode() != 400 || !strings.Contains(string(refusal.GetBody()), "invalid_json")):
			t.Errorf("%s: the last chunk's answer %v, want 400 invalid_json", c.name, m)
		case c.owned != "" && c.owned != "invalid_json" && (refusal.GetStatus().GetCode() != 400 || !strings.Contains(string(refusal.GetBody()), `"param":"`+c.owned+`"`)):
			t.Errorf("%s: the last chunk's answer %v, want 400 naming %s", c.name, m, c.owned)
		case c.owned == "" && m.GetRequestBody() == nil:
			t.Errorf("%s: the last chunk's answer %v, want it let through", c.name, m)
		}
		st.CloseSend()
	}
	st := opened(filterv3.ProcessingMode_NONE, http.MethodPost, "/v1/chat/completions", false)
	if m, err := st.Recv(); err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 500 || !strings.Contains(string(m.GetImmediateResponse().GetBody()), "epp_body_unread") {
		t.Errorf("NONE mode, an inference request with a body: %v %v", m, err)
	}
	st = opened(filterv3.ProcessingMode_NONE, http.MethodGet, "/v1/models", true)
	if m, err := st.Recv(); err != nil || m.GetRequestHeaders() == nil {
		t.Errorf("NONE mode, GET /v1/models: %v %v", m, err)
	}
}

// The body the picker hands back is written for its choice: a fallback that would read it
// otherwise (here: one worker takes Baton's priority field, the other is not marked to) is not
// listed; two alike are.
func TestPortFallbacksTakeTheChoicesBody(t *testing.T) {
	t.Parallel()
	a, b := simulated(t), simulated(t)
	a.ForwardPriority = true
	p := startPicker(t, []config.Worker{a, b})
	for i := range 4 {
		st := requestStream(t, context.Background(), p.client(), `{"model":"m","prompt":"x `+strconv.Itoa(i)+`"}`)
		if eps := destinations(t, st); len(eps) != 1 {
			t.Errorf("a choice with a fallback that reads the body otherwise: %v", eps)
		}
		st.CloseSend()
	}
	b.ForwardPriority = true
	alike := startPicker(t, []config.Worker{a, b})
	if eps := destinations(t, requestStream(t, context.Background(), alike.client(), `{"model":"m","prompt":"x"}`)); len(eps) != 2 {
		t.Errorf("two workers alike: %v, want the choice and a fallback", eps)
	}
}

// An immediate response ends the exchange: the picker does not hold the stream for a data plane
// that keeps it open (a refusal costs no place among the exchanges); a BUFFERED_PARTIAL body
// past the proxy's buffer is refused 413 rather than read as a whole body.
func TestPortRefusalsEndTheExchange(t *testing.T) {
	t.Parallel()
	p := startPicker(t, []config.Worker{simulated(t)})
	st, err := p.client().Process(context.Background())
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
	poll.Until(t, "no exchange held", func() bool { return testutil.ToFloat64(p.metrics.EPPStreams) == 0 })

	st, err = p.client().Process(context.Background())
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
}

// A STREAMED body that ends with trailers after the pick is still checked at its end: one
// carrying a field Baton owns is refused, not let through because no chunk said end of stream.
func TestPortOwnedFieldsNeverPassBehindTrailers(t *testing.T) {
	t.Parallel()
	p := startPicker(t, []config.Worker{simulated(t)})
	st, err := p.client().Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	first := dataplane.RequestHeaders(http.MethodPost, "", "/v1/chat/completions", nil, false)
	first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_STREAMED}
	st.Send(first)
	if m, err := st.Recv(); err != nil || m.GetRequestHeaders() == nil {
		t.Fatalf("the headers' answer: %v %v", m, err)
	}
	body := `{"model":"m","messages":[{"role":"user","content":"x"}],"kv_transfer_params":{"do_remote_prefill":true},"priority":-1000}`
	for _, part := range []string{body[:40], body[40:]} {
		st.Send(dataplane.RequestBody([]byte(part), false))
		if m, err := st.Recv(); err != nil || m.GetRequestBody() == nil {
			t.Fatalf("a chunk: %v %v", m, err)
		}
	}
	st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}})
	m, err := st.Recv()
	if err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 400 || !strings.Contains(string(m.GetImmediateResponse().GetBody()), "owned_field") {
		t.Fatalf("the trailers' answer: %v %v, want 400 owned_field", m, err)
	}
}

// The guard is not a matter of spelling: a POST to a path an engine's server may route to an
// inference handler (escaped, doubled or trailing slashes, parameters) is guarded as the route
// itself — refused at the end of a STREAMED body carrying an owned field, refused unread in NONE.
func TestPortGuardsEverySpellingOfARoute(t *testing.T) {
	t.Parallel()
	p := startPicker(t, []config.Worker{simulated(t)})
	open := func(mode filterv3.ProcessingMode_BodySendMode, path string) extprocv3.ExternalProcessor_ProcessClient {
		st, err := p.client().Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		first := dataplane.RequestHeaders(http.MethodPost, "", path, nil, false)
		first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: mode}
		st.Send(first)
		return st
	}
	for _, path := range []string{"/v1/%63hat/completions", "/v1/chat%2Fcompletions", "//v1/chat/completions", "/v1/chat/completions/", "/v1/chat/completions;x", "/v1/./chat/completions"} {
		st := open(filterv3.ProcessingMode_STREAMED, path)
		if m, err := st.Recv(); err != nil || m.GetRequestHeaders() == nil {
			t.Fatalf("%s: the headers' answer: %v %v", path, m, err)
		}
		st.Send(dataplane.RequestBody([]byte(`{"model":"m","messages":[],"priority":-1000}`), true))
		if m, err := st.Recv(); err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 400 {
			t.Errorf("STREAMED %s with an owned field: %v %v, want 400", path, m, err)
		}
		st = open(filterv3.ProcessingMode_NONE, path)
		if m, err := st.Recv(); err != nil || m.GetImmediateResponse().GetStatus().GetCode() != 500 {
			t.Errorf("NONE %s with a body: %v %v, want 500 epp_body_unread", path, m, err)
		}
	}
}

// A STREAMED body that comes after the pick is part of the request path: one not whole within
// body_timeout ends the stream (counted), and the picked worker's count in flight with it.
func TestPortStreamedBodyEndsAtTheBodyTimeout(t *testing.T) {
	t.Parallel()
	a := simulated(t)
	p := startPicker(t, []config.Worker{a}, func(c *config.Config) { c.BodyTimeout, c.RequestTimeout = 400*time.Millisecond, time.Minute })
	st, err := p.client().Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	first := dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false)
	first.ProtocolConfig = &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_STREAMED}
	st.Send(first)
	if m, err := st.Recv(); err != nil || m.GetRequestHeaders() == nil {
		t.Fatalf("the headers' answer: %v %v", m, err)
	}
	st.Send(dataplane.RequestBody([]byte(`{"model":"m",`), false)) // and the rest never comes
	if m, err := st.Recv(); err != nil || m.GetRequestBody() == nil {
		t.Fatalf("the chunk's answer: %v %v", m, err)
	}
	if _, err := st.Recv(); status.Code(err) != grpccodes.DeadlineExceeded || !strings.Contains(err.Error(), "body_timeout") {
		t.Fatalf("a body that never ends: %v, want DEADLINE_EXCEEDED at body_timeout", err)
	}
	if n := testutil.ToFloat64(p.metrics.EPPCut.WithLabelValues("request_phase_timeout")); n != 1 {
		t.Errorf("request_phase_timeout counted %v", n)
	}
	poll.Until(t, "the request ended", p.idle)
}
