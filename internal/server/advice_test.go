package server

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/baton-llm/baton/internal/advisor"
	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

// adviceServer is a PD server of one prefill and one decode whose advisor has fitted 200
// requests; now is its advisor's clock.
func adviceServer(t *testing.T, now func() time.Time) (*Server, *metrics.Metrics) {
	t.Helper()
	reg := worker.NewRegistry(worker.New(config.Worker{URL: "http://p:1", Role: config.RolePrefill}), worker.New(config.Worker{URL: "http://d:1", Role: config.RoleDecode}))
	m := metrics.New(reg)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	t0 := time.Unix(1_000_000, 0)
	adv := &advisor.Advisor{Now: now}
	for i := range 200 {
		u := 200 + 37*(i%50)
		leg := 0.004 + float64(u)/30_000
		tpot := 0.007 + 0.0002*float64(i%9)
		adv.Observe(advisor.Sample{At: t0.Add(time.Duration(i) * 100 * time.Millisecond), Split: true, Prompt: u, Uncached: u, Output: 50,
			PrefillTime: secs(leg), PrefillBusy: 0, TTFT: secs(leg + 0.012), TPOT: secs(tpot), DecodeBusy: i % 9})
	}
	px := &proxy.Proxy{Transport: http.DefaultTransport, Metrics: m, Log: log}
	s := New(Options{RequestTimeout: time.Minute, StalledClientTimeout: time.Minute, Proxy: px, Director: director.Options{Registry: reg, Metrics: m, Log: log,
		PD: true, Advisor: adv, AdviceSLO: advisor.SLO{TTFT: 2 * time.Second, TPOT: 50 * time.Millisecond}}})
	m.Registry.MustRegister(s.Director().AdviceCollector())
	return s, m
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// whatIf is a GET /pd/advice what-if from client (a host).
func whatIf(client, query string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "/pd/advice?"+query, nil)
	r.RemoteAddr = client + ":40000"
	return r
}

// whenDone waits for done, or fails the test just before its deadline (go test -timeout): a
// wait that never ends is reported as what it is, not as the binary's panic. No duration is
// asserted: the wait succeeds however long it takes within the test's own limit.
func whenDone(t *testing.T, done <-chan struct{}, what string) {
	t.Helper()
	var expired <-chan time.Time
	if d, ok := t.Deadline(); ok {
		expired = time.After(time.Until(d) - 5*time.Second)
	}
	select {
	case <-done:
	case <-expired:
		t.Fatalf("%s: still waiting at the test's deadline", what)
	}
}

// A client may have director.MaxWhatIfsPerClient what-ifs being answered at once, and all
// clients director.MaxWhatIfs: one past either is a 429 in the error envelope, answered at
// once; the fleet's own advice (no parameters) is never refused; a slot given back is taken
// again. Each what-if is held inside its fit (its advisor's clock waits) until released.
func TestWhatIfsBoundedPerClientAndInAll(t *testing.T) {
	var armed atomic.Int64 // the fits to hold: one per what-if hold sends
	computing, release := make(chan struct{}, director.MaxWhatIfs), make(chan struct{})
	s, _ := adviceServer(t, func() time.Time {
		for n := armed.Load(); n > 0; n = armed.Load() {
			if armed.CompareAndSwap(n, n-1) {
				computing <- struct{}{}
				<-release
				break
			}
		}
		return time.Unix(1_000_020, 0)
	})
	h := s.StatusHandler()
	var held sync.WaitGroup
	var recs []*httptest.ResponseRecorder
	hold := func(client string) {
		rec := httptest.NewRecorder()
		recs = append(recs, rec)
		armed.Add(1)
		held.Go(func() { h.ServeHTTP(rec, whatIf(client, "total=4")) })
		whenDone(t, computing, "a what-if from "+client+" computing")
	}
	refused := func(client, why string) {
		t.Helper()
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, whatIf(client, "total=5&tpot_slo=40ms"))
		var env struct {
			Error struct{ Message, Type, Code string } `json:"error"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &env); rec.Code != http.StatusTooManyRequests || err != nil ||
			env.Error.Type != "rate_limit_error" || env.Error.Code != "too_many_what_ifs" || env.Error.Message == "" || rec.Header().Get("Retry-After") == "" {
			t.Errorf("%s: %d %.200s (Retry-After %q), want 429 too_many_what_ifs in the error envelope", why, rec.Code, rec.Body, rec.Header().Get("Retry-After"))
		}
	}
	for range director.MaxWhatIfsPerClient {
		hold("10.0.0.1")
	}
	refused("10.0.0.1", "one what-if past the client's bound")
	for i := director.MaxWhatIfsPerClient; i < director.MaxWhatIfs; i++ {
		hold("10.0.0.2")
	}
	refused("10.0.0.3", "another client's what-if past the bound in all")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, whatIf("10.0.0.1", ""))
	if rec.Code != http.StatusOK {
		t.Errorf("the fleet's own advice while what-ifs are answered: %d %.200s", rec.Code, rec.Body)
	}
	close(release)
	held.Wait()
	for _, rec := range recs {
		if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), `"total":4`) {
			t.Errorf("a what-if held in progress: %d %.200s", rec.Code, rec.Body)
		}
	}
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, whatIf("10.0.0.3", "total=6"))
	if rec.Code != http.StatusOK {
		t.Errorf("a what-if once the others were answered: %d %.200s", rec.Code, rec.Body)
	}
}

// A scrape of /metrics (the advisor's collector: the fleet's advice) completes while a what-if
// is in the middle of its computation: the what-if is held inside its fit (its advisor's clock
// waits) until the scrape has its answer.
func TestScrapeNotBlockedByWhatIf(t *testing.T) {
	now := time.Unix(1_000_020, 0)
	var first atomic.Bool
	computing, release := make(chan struct{}), make(chan struct{})
	s, m := adviceServer(t, func() time.Time {
		if first.CompareAndSwap(false, true) { // the what-if's fit
			close(computing)
			<-release
		}
		return now
	})
	h := s.StatusHandler()
	answered := make(chan struct{})
	rec := httptest.NewRecorder()
	go func() {
		defer close(answered)
		h.ServeHTTP(rec, whatIf("10.0.0.1", "total=8&ttft_slo=1s"))
	}()
	whenDone(t, computing, "the what-if computing")
	scraped := make(chan struct{})
	scrape := httptest.NewRecorder()
	go func() {
		defer close(scraped)
		m.Handler().ServeHTTP(scrape, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	}()
	whenDone(t, scraped, "a /metrics scrape while a what-if is computing")
	if scrape.Code != http.StatusOK || !strings.Contains(scrape.Body.String(), `baton_pd_recommended_workers{role="decode"}`) {
		t.Errorf("the scrape: %d, without the advice:\n%s", scrape.Code, scrape.Body)
	}
	close(release)
	whenDone(t, answered, "the what-if, released")
	if rec.Code != http.StatusOK || !strings.Contains(rec.Body.String(), `"total":8`) {
		t.Errorf("the what-if: %d %s", rec.Code, rec.Body)
	}
}
