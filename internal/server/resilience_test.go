package server

// Failing and overloaded engines through the HTTP door: retries that give the exact answer,
// bodies replayed byte for byte, and an admission queue that refuses what it cannot hold.

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/sim"
	"github.com/baton-llm/baton/internal/worker"
)

// simulatedFleet is a gateway over simulated vLLM engines serving "m"; tune changes the options.
func simulatedFleet(t *testing.T, engines []sim.Config, tune ...func(*Options)) ([]*sim.Engine, *Server, string) {
	t.Helper()
	var es []*sim.Engine
	var urls []string
	for _, c := range engines {
		c.Engine, c.Model = sim.EngineVLLM, "m"
		e := startSim(t, c)
		es = append(es, e)
		urls = append(urls, e.URL())
	}
	s, gw, _ := gateway(t, urls, tune...)
	return es, s, gw
}

// Over a worker that refuses half of its requests, every request gets the simulator's exact
// answer, and the retries are counted.
func TestRetriesOverAFailingWorker(t *testing.T) {
	t.Parallel()
	_, s, gw := simulatedFleet(t, []sim.Config{{}, {Faults: sim.Faults{Status: 503, Rate: 0.5}}})
	for i := range 100 {
		prompt := fmt.Sprintf("retry me %d", i)
		resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"`+prompt+`","max_tokens":4,"ignore_eos":true}`)
		toks, _ := sim.Generate(sim.Digest(sim.Tokenize(prompt)), sim.Sampling{MaxTokens: 4, IgnoreEOS: true})
		if resp.StatusCode != 200 || gwtest.AnswerText(t, body) != sim.Detokenize(toks) {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	if n := testutil.ToFloat64(s.metrics.Retries.WithLabelValues("POST /v1/completions", "status_503")); n == 0 {
		t.Error("no retry was counted")
	}
}

// The body of a retried request is the client's bytes again, byte for byte.
func TestRetryReplaysTheBody(t *testing.T) {
	t.Parallel()
	var calls atomic.Int32
	got := make(chan string, 2)
	up := engine(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- string(b)
		if calls.Add(1) == 1 {
			c, _, _ := w.(http.Hijacker).Hijack() // the first attempt dies before answering
			c.Close()
			return
		}
		io.WriteString(w, `{"ok":true}`)
	})
	_, gw, _ := gateway(t, []string{up})
	body := `{"model":"m","seed":9007199254740993,"s":"\u00e9"}`
	if resp, b := post(t, gw+"/v1/completions", body); resp.StatusCode != 200 {
		t.Fatalf("status %d %s", resp.StatusCode, b)
	}
	if a, b := <-got, <-got; a != body || b != body {
		t.Errorf("attempts got %q and %q, want %q twice", a, b, body)
	}
}

// admitting bounds the requests served at once and the queue behind them.
func admitting(running, queue int, timeout time.Duration) func(*Options) {
	return func(o *Options) {
		o.Director.Admission = config.Default().Admission
		o.Director.Admission.MaxConcurrentRequests, o.Director.Admission.QueueSize, o.Director.Admission.QueueTimeout = running, queue, timeout
	}
}

// One request runs, one waits: a third finds the queue full (503 queue_full with Retry-After,
// counted) and both admitted ones are served. A request that waits past the queue timeout is
// refused (504 queue_timeout with Retry-After), not kept forever.
func TestOverload(t *testing.T) {
	t.Parallel()
	es, s, gw := simulatedFleet(t, []sim.Config{{DecodePerToken: 100 * time.Millisecond}}, admitting(1, 1, 2*time.Second))
	slow := `{"model":"m","prompt":"slow","max_tokens":5,"ignore_eos":true}`
	var wg sync.WaitGroup
	statuses := make(chan int, 2)
	for i := range 2 { // one runs, one waits in the queue
		wg.Go(func() {
			resp, err := http.Post(gw+"/v1/completions", "application/json", strings.NewReader(slow))
			if err != nil {
				statuses <- 0
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses <- resp.StatusCode
		})
		if i == 0 {
			poll.Until(t, "running", func() bool { return es[0].Stats().RequestsReceived == 1 })
		} else {
			poll.Until(t, "queued", func() bool { return testutil.ToFloat64(s.metrics.QueueDepth.WithLabelValues("default")) == 1 })
		}
	}
	resp, body := post(t, gw+"/v1/completions", slow) // the queue is full
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" || errorCode(t, body) != "queue_full" {
		t.Fatalf("overflow: %d retry-after %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	wg.Wait()
	close(statuses)
	for st := range statuses {
		if st != 200 {
			t.Errorf("admitted request: %d", st)
		}
	}
	if v := testutil.ToFloat64(s.metrics.Rejections.WithLabelValues("queue_full")); v != 1 {
		t.Errorf("rejections %v", v)
	}

	es2, _, gw2 := simulatedFleet(t, []sim.Config{{DecodePerToken: 400 * time.Millisecond}}, admitting(1, 5, time.Second))
	first := make(chan struct{})
	go func() {
		defer close(first)
		if resp, err := http.Post(gw2+"/v1/completions", "application/json", strings.NewReader(slow)); err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	defer func() { <-first }()
	poll.Until(t, "running", func() bool { return es2[0].Stats().RequestsReceived == 1 })
	r2, body := gwtest.PostTimeout(t, gw2+"/v1/completions", slow)
	if r2.StatusCode != 504 || !strings.Contains(body, "queue_timeout") || r2.Header.Get("Retry-After") == "" {
		t.Errorf("queue timeout: %d %s", r2.StatusCode, body)
	}
}

// A stream whose engine goes silent after its first events is given up on after the stream
// stall timeout, not held until the request deadline: the client's connection is aborted (no
// [DONE]), baton_upstream_errors_total{kind="stalled"}, a WARN and the status page's recent
// errors name the worker, and the worker's circuit hears it — on both upstream clients. The soak found a hung engine held its
// streams' clients until the deadline, unseen meanwhile.
func TestAStreamWhoseEngineGoesSilentIsGivenUp(t *testing.T) {
	for _, client := range []string{"net", "baton"} {
		t.Run(client, func(t *testing.T) {
			e := simOf(t, sim.Config{Engine: sim.EngineVLLM, Faults: sim.Faults{HangAfter: 2}})
			var logs gwtest.SyncBuffer
			s, gw, ws := gateway(t, []string{e.URL()}, func(o *Options) {
				tr := proxy.NewTransport(client)
				t.Cleanup(func() { proxy.CloseIdle(tr, "") })
				o.Proxy.Transport, o.Proxy.StallTimeout = tr, 300*time.Millisecond
				o.Proxy.Log = slog.New(slog.NewTextHandler(&logs, nil))
			})
			ws[0].UseBreaker(&worker.BreakerConfig{FailureThreshold: 1, SuccessThreshold: 1, Timeout: time.Minute})
			b, err := gwtest.ReadStream(t, gw+"/v1/completions", `{"model":"m","prompt":"hello","max_tokens":50,"ignore_eos":true,"stream":true}`, 10*time.Second)
			if err == nil || strings.Contains(b, "[DONE]") || strings.Count(b, "data: ") != 2 {
				t.Errorf("want the 2 events the engine sent, then the connection aborted: %q, %v", b, err)
			}
			poll.Until(t, "the stall counted", func() bool {
				return strings.Contains(scrape(t, s), `baton_upstream_errors_total{kind="stalled",worker="`+e.URL()+`"} 1`)
			})
			if l := logs.String(); !strings.Contains(l, "sent nothing mid-stream") || !strings.Contains(l, e.URL()) {
				t.Errorf("no WARN naming the worker:\n%s", l)
			}
			// The status page lists the cut answer among the recent errors, naming the worker.
			st := httptest.NewRecorder()
			s.StatusHandler().ServeHTTP(st, httptest.NewRequest(http.MethodGet, "/status.json", nil))
			if j := st.Body.String(); !strings.Contains(j, `"code":"cut_mid_answer"`) || !strings.Contains(j, `"worker":"`+e.URL()+`"`) {
				t.Errorf("the status page does not show the cut stream: %s", j)
			}
			if got := ws[0].BreakerState(); got != worker.BreakerOpen {
				t.Errorf("the worker's circuit is %v after a stall at a threshold of one failure: it did not hear it", got)
			}
		})
	}
}

// The engine's progress is every byte it sends, not every whole event: a limited tenant's
// stream (read event by event, for its accounting) whose engine sends each event in slow pieces,
// never silent for a stall timeout, is relayed whole.
func TestAnEventInSlowPiecesIsNoStall(t *testing.T) {
	up := engine(t, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i := range 3 {
			ev := fmt.Sprintf(`data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"t%d","finish_reason":null}]}`+"\n\n", i)
			for _, piece := range []string{ev[:20], ev[20:40], ev[40:]} { // 600 ms an event, 200 ms between bytes
				io.WriteString(w, piece)
				rc.Flush()
				time.Sleep(200 * time.Millisecond)
			}
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	s, gw, _ := gateway(t, []string{up}, func(o *Options) {
		o.Proxy.StallTimeout = 500 * time.Millisecond
		withTenants(t, o, config.Tenant{Name: "team", Keys: []string{config.HashKey("sk-team")}, Limits: &config.Limits{TokensPerMinute: intp(1_000_000)}})
	})
	resp, b := asTenant(t, gw+"/v1/completions", "sk-team", `{"model":"m","prompt":"x","max_tokens":3,"stream":true}`)
	if resp.StatusCode != 200 || !strings.Contains(b, "data: [DONE]") || strings.Count(b, `"text":"t`) != 3 {
		t.Errorf("a stream sent in slow pieces was cut: %d %q", resp.StatusCode, b)
	}
	if m := scrape(t, s); strings.Contains(m, `kind="stalled"`) {
		t.Error("an engine sending bytes was counted as stalled")
	}
}
