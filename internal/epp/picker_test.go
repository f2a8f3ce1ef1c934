package epp_test

// The Endpoint Picker over Baton's director, through its gRPC port as the gateway builds it
// (epp.NewGRPC): a data plane in front, simulated or fake engines behind, the requests counted
// in a test host the way the gateway counts them.

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/epp/dataplane"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// books is the gateway a test picker counts its requests in: in flight, and each finished one
// with the status it ended with.
type books struct {
	mu       sync.Mutex
	inFlight int
	done     []ended
	bg       sync.WaitGroup
}

type ended struct {
	rec    *record.Record
	status int
}

func (b *books) Begin() { b.mu.Lock(); b.inFlight++; b.mu.Unlock() }
func (b *books) Finish(_ context.Context, rec *record.Record, _ int64, status int, _ trace.Span, _ bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.inFlight--
	b.done = append(b.done, ended{rec, status})
}
func (b *books) Go(f func()) { b.bg.Go(f) }

// ended returns the requests finished with status.
func (b *books) endedWith(status int) []*record.Record {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []*record.Record
	for _, e := range b.done {
		if e.status == status {
			out = append(out, e.rec)
		}
	}
	return out
}

// budget is the process-wide body budget the HTTP listener's bodies and the picker's share;
// peak is the most it held at once.
type budget struct{ held, limit, peak atomic.Int64 }

func (b *budget) hand() (func(int64) bool, func(int64)) {
	take := func(n int64) bool {
		h := b.held.Add(n)
		if h > b.limit.Load() {
			b.held.Add(-n)
			return false
		}
		for p := b.peak.Load(); h > p && !b.peak.CompareAndSwap(p, h); p = b.peak.Load() {
		}
		return true
	}
	return take, func(n int64) { b.held.Add(-n) }
}

// picker is an Endpoint Picker under test: its fleet, metrics, books and body budget, and a
// client connection to its gRPC port.
type picker struct {
	reg     *worker.Registry
	metrics *metrics.Metrics
	books   *books
	budget  *budget
	conn    *grpc.ClientConn
}

// startPicker serves the picker over workers (registered and ready, as the registrar leaves
// workers whose engines answered; vLLM serving "m" unless they say otherwise) with the
// configuration's defaults, which tune changes.
func startPicker(t *testing.T, workers []config.Worker, tune ...func(*config.Config)) *picker {
	t.Helper()
	cfg := config.Default()
	for _, f := range tune {
		f(&cfg)
	}
	var ws []*worker.Worker
	for _, c := range workers {
		if c.Runtime == "" {
			c.Runtime = config.RuntimeVLLM
		}
		if c.Models == nil {
			c.Models = []string{"m"}
		}
		w := worker.New(c)
		var ms []worker.Model
		for _, m := range c.Models {
			ms = append(ms, worker.Model{ID: m})
		}
		w.SetInfo(&worker.Info{Runtime: c.Runtime, Models: ms})
		w.SetReady(true)
		ws = append(ws, w)
	}
	reg := worker.NewRegistry(ws...)
	m := metrics.New(reg)
	pol, err := policy.New(cfg.Policy, cfg)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	d := director.New(director.Options{Registry: reg, Metrics: m, Log: log, MaxBatchSize: cfg.MaxBatchSize,
		Admission: cfg.Admission, Retry: cfg.Retry,
		Selector: &policy.Selector{Registry: reg, Policies: map[string]policy.Policy{config.RoleRegular: pol}},
		Models:   func() (map[string]config.ModelConfig, string) { return cfg.Models, cfg.DefaultModel }})
	p := &picker{reg: reg, metrics: m, books: &books{}, budget: &budget{}}
	p.budget.limit.Store(cfg.MaxBufferedBodyBytes)
	srv, hs := epp.NewGRPC(epp.Port{Director: d, Metrics: m, Host: p.books, BodyBudget: p.budget.hand, Log: log, Config: cfg})
	epp.SetReady(hs, true)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	p.conn, err = grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.conn.Close(); srv.Stop(); p.books.bg.Wait() })
	return p
}

// worker is the fleet's worker at url.
func (p *picker) worker(url string) *worker.Worker {
	for _, w := range p.reg.Snapshot().Workers {
		if w.URL == url {
			return w
		}
	}
	return nil
}

// idle reports whether no request is in flight on any worker or in the books.
func (p *picker) idle() bool {
	for _, w := range p.reg.Snapshot().Workers {
		if w.InFlight() != 0 {
			return false
		}
	}
	p.books.mu.Lock()
	defer p.books.mu.Unlock()
	return p.books.inFlight == 0
}

// dataPlane serves a test data plane in front of the picker.
func (p *picker) dataPlane(t *testing.T, tune ...func(*dataplane.Proxy)) (*dataplane.Proxy, string) {
	t.Helper()
	dp := &dataplane.Proxy{Picker: extprocv3.NewExternalProcessorClient(p.conn), Client: &http.Client{}}
	for _, f := range tune {
		f(dp)
	}
	srv := httptest.NewServer(dp)
	t.Cleanup(srv.Close)
	return dp, srv.URL
}

// client is a new ext_proc client of the picker.
func (p *picker) client() extprocv3.ExternalProcessorClient {
	return extprocv3.NewExternalProcessorClient(p.conn)
}

// simulated starts a simulated vLLM engine serving "m" and returns its worker's configuration.
func simulated(t *testing.T) config.Worker {
	t.Helper()
	e, err := sim.Start(sim.Config{Engine: sim.EngineVLLM, Model: "m"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return config.Worker{URL: e.URL()}
}

// fake is a worker's configuration over a fake engine answering with h.
func fake(t *testing.T, h http.HandlerFunc) config.Worker {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return config.Worker{URL: srv.URL}
}

// ask posts body to url (header pairs after it) and returns the answer read whole.
func ask(t *testing.T, url, body string, header ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(b)
}

// wantRefused checks an answer is the OpenAI error envelope with status and code.
func wantRefused(t *testing.T, resp *http.Response, body string, status int, code string) {
	t.Helper()
	var env struct {
		Error struct {
			Message, Code string
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &env); err != nil || resp.StatusCode != status || env.Error.Code != code || env.Error.Message == "" {
		t.Errorf("%d %s, want %d %s in the error envelope", resp.StatusCode, body, status, code)
	}
}

// endpointOf is a worker URL's host:port, as the picker names endpoints.
func endpointOf(url string) string { return strings.TrimPrefix(url, "http://") }

// requestStream opens an ext_proc stream and sends a completion request's headers and body as
// Envoy does.
func requestStream(t *testing.T, ctx context.Context, c extprocv3.ExternalProcessorClient, body string) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	st, err := c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", http.Header{"Content-Type": {"application/json"}}, false)); err != nil {
		t.Fatal(err)
	}
	for rest := []byte(body); ; {
		n := min(len(rest), 64<<10)
		if err := st.Send(dataplane.RequestBody(rest[:n], n == len(rest))); err != nil {
			t.Fatal(err)
		}
		if rest = rest[n:]; len(rest) == 0 {
			return st
		}
	}
}

// sendSpaces sends n bytes of a body that does not end, in chunks of 64 KiB as a data plane
// streams them.
func sendSpaces(st extprocv3.ExternalProcessor_ProcessClient, n int) {
	for n > 0 {
		c := min(n, 64<<10)
		st.Send(dataplane.RequestBody(bytes.Repeat([]byte(" "), c), false))
		n -= c
	}
}

// destinations reads the request path's answers up to the end of the handed-back body and
// returns the destination list.
func destinations(t *testing.T, st extprocv3.ExternalProcessor_ProcessClient) []string {
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

// httpClosed is the URL of a port that refuses connections: an engine gone.
func httpClosed(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	return "http://" + ln.Addr().String()
}
