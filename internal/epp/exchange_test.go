package epp_test

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/baton-llm/baton/internal/epp"
	"github.com/baton-llm/baton/internal/epp/dataplane"
	"github.com/baton-llm/baton/internal/openai"
)

// fakePicker answers with pick (or err) and records what it was asked and what ended.
type fakePicker struct {
	pick *epp.Pick
	err  error

	mu       sync.Mutex
	asked    []*epp.Request
	served   []string
	outcomes []epp.Outcome
	done     chan struct{}
}

func (f *fakePicker) Pick(_ context.Context, req *epp.Request) (*epp.Pick, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r := *req
	r.Body = append([]byte(nil), req.Body...) // the exchange's buffer is its own once the pick returns
	f.asked = append(f.asked, &r)
	if f.err != nil {
		return nil, f.err
	}
	p := *f.pick
	p.Served = func(ep string) { f.mu.Lock(); f.served = append(f.served, ep); f.mu.Unlock() }
	p.Done = func(o epp.Outcome) {
		f.mu.Lock()
		f.outcomes = append(f.outcomes, o)
		f.mu.Unlock()
		close(f.done)
	}
	return &p, nil
}

// serve runs s over an in-memory connection and returns a client of it.
func serve(t *testing.T, s *epp.Server) extprocv3.ExternalProcessorClient {
	t.Helper()
	ln := bufconn.Listen(1 << 20)
	g := grpc.NewServer()
	extprocv3.RegisterExternalProcessorServer(g, s)
	go g.Serve(ln)
	conn, err := grpc.NewClient("passthrough:///epp", grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return ln.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(); g.Stop() })
	return extprocv3.NewExternalProcessorClient(conn)
}

func open(t *testing.T, c extprocv3.ExternalProcessorClient) extprocv3.ExternalProcessor_ProcessClient {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	st, err := c.Process(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func send(t *testing.T, st extprocv3.ExternalProcessor_ProcessClient, ms ...*extprocv3.ProcessingRequest) {
	t.Helper()
	for _, m := range ms {
		if err := st.Send(m); err != nil {
			t.Fatal(err)
		}
	}
}

// One exchange as a data plane makes it: the body assembled from its chunks reaches the picker
// with the method, path and headers; the pick comes back as the destination header and the
// dynamic metadata (the choice, then the fallbacks), with the picker's body in place of the
// client's; the endpoint the proxy reports served, the response's status, bytes and usage reach
// the picker when the exchange ends.
func TestExchange(t *testing.T) {
	f := &fakePicker{pick: &epp.Pick{Endpoints: []string{"10.0.0.1:8000", "10.0.0.2:8000"}, Body: []byte(`{"model":"served"}`)}, done: make(chan struct{})}
	st := open(t, serve(t, &epp.Server{Picker: f, MaxBody: 1 << 20}))
	send(t, st,
		dataplane.RequestHeaders(http.MethodPost, "gw", "/v1/completions", http.Header{"Content-Type": {"application/json"}, "X-Team": {"a"}}, false),
		dataplane.RequestBody([]byte(`{"model":`), false),
		dataplane.RequestBody([]byte(`"alias"}`), true))
	var dest, meta string
	var body []byte
	for body == nil {
		m, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range m.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
			if h.GetHeader().GetKey() == epp.HeaderDestination {
				dest = string(h.GetHeader().GetRawValue())
			}
		}
		if d := dataplane.Destination(m); d != "" {
			meta = d
		}
		if sr := m.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse(); sr != nil {
			body = append(body, sr.GetBody()...)
			if !sr.GetEndOfStream() {
				body = nil
			}
		}
		if b := m.GetRequestBody().GetResponse().GetBodyMutation().GetBody(); b != nil {
			body = b
		}
	}
	if dest != "10.0.0.1:8000,10.0.0.2:8000" || meta != dest || string(body) != `{"model":"served"}` {
		t.Fatalf("destination %q, metadata %q, body %q", dest, meta, body)
	}
	f.mu.Lock()
	req := f.asked[0]
	f.mu.Unlock()
	if req.Method != http.MethodPost || req.Path != "/v1/completions" || req.Header.Get("X-Team") != "a" || string(req.Body) != `{"model":"alias"}` {
		t.Fatalf("the picker was asked %+v (body %q)", req, req.Body)
	}
	send(t, st, dataplane.ResponseHeaders(http.StatusOK, http.Header{"Content-Type": {"application/json"}}, "10.0.0.2:8000", false))
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	answer := `{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8}}`
	send(t, st, dataplane.ResponseBody([]byte(answer), true))
	st.CloseSend()
	for {
		if _, err := st.Recv(); err != nil {
			break
		}
	}
	select {
	case <-f.done:
	case <-time.After(5 * time.Second):
		t.Fatal("the exchange never ended for the picker")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	o := f.outcomes[0]
	if len(f.served) != 1 || f.served[0] != "10.0.0.2:8000" {
		t.Errorf("served %v", f.served)
	}
	if o.Status != 200 || !o.UsageKnown || o.Usage.Prompt != 3 || o.Usage.Completion != 5 || o.Bytes != int64(len(answer)) || o.FirstByte.IsZero() {
		t.Errorf("outcome %+v", o)
	}
}

// A refusal is the proxy's immediate answer to the client: the picker's status and OpenAI
// envelope. A body past MaxBody is refused 413 before the picker is asked.
func TestRefusals(t *testing.T) {
	refusal := &openai.Error{Status: http.StatusTooManyRequests, Code: openai.CodeRequestShed, Message: "shed"}
	for _, c := range []struct {
		name   string
		err    error
		body   string
		status int
		code   string
		asked  int
	}{
		{"the picker's refusal", refusal, `{"model":"m"}`, 429, openai.CodeRequestShed, 1},
		{"a body past MaxBody", nil, `{"model":"` + strings.Repeat("x", 200) + `"}`, 413, openai.CodePayloadTooLarge, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := &fakePicker{pick: &epp.Pick{Endpoints: []string{"10.0.0.1:8000"}}, err: c.err, done: make(chan struct{})}
			st := open(t, serve(t, &epp.Server{Picker: f, MaxBody: 100}))
			send(t, st, dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false), dataplane.RequestBody([]byte(c.body), true))
			var imm *extprocv3.ImmediateResponse
			for imm == nil {
				m, err := st.Recv()
				if err != nil {
					t.Fatal(err)
				}
				imm = m.GetImmediateResponse()
			}
			var env struct{ Error struct{ Code string } }
			if int(imm.GetStatus().GetCode()) != c.status || json.Unmarshal(imm.GetBody(), &env) != nil || env.Error.Code != c.code {
				t.Errorf("immediate answer %d %s", imm.GetStatus().GetCode(), imm.GetBody())
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			if len(f.asked) != c.asked {
				t.Errorf("the picker was asked %d times, want %d", len(f.asked), c.asked)
			}
		})
	}
}

// The data plane's behaviour is bounded: past MaxStreams a new stream ends at once with
// RESOURCE_EXHAUSTED, and a stream that sends nothing ends at RequestPhase with
// DEADLINE_EXCEEDED — each counted by its reason.
func TestStreamsAreBounded(t *testing.T) {
	var mu sync.Mutex
	cut := map[string]int{}
	f := &fakePicker{pick: &epp.Pick{Endpoints: []string{"10.0.0.1:8000"}}, done: make(chan struct{})}
	c := serve(t, &epp.Server{Picker: f, MaxBody: 1 << 20, MaxStreams: 1, RequestPhase: 200 * time.Millisecond,
		Cut: func(reason string) { mu.Lock(); cut[reason]++; mu.Unlock() }})
	idle := open(t, c) // holds the one stream, and sends nothing
	send(t, idle, dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false))
	time.Sleep(50 * time.Millisecond)
	second := open(t, c)
	_ = second.Send(dataplane.RequestHeaders(http.MethodPost, "", "/v1/completions", nil, false)) // may meet the stream already ended
	if _, err := second.Recv(); status.Code(err) != codes.ResourceExhausted {
		t.Errorf("a stream past MaxStreams: %v", err)
	}
	for {
		_, err := idle.Recv()
		if err != nil {
			if status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("an idle stream: %v", err)
			}
			break
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if cut["max_streams"] != 1 || cut["request_phase_timeout"] != 1 {
		t.Errorf("cuts counted %v", cut)
	}
}
