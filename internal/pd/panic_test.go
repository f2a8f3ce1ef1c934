package pd

import (
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/outcome"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/worker"
)

// legTransport panics on requests to the prefill and holds the decode's until it is cancelled,
// as a decode waiting for its bootstrap partner does.
type legTransport struct{ prefill string }

func (l legTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.HasPrefix(r.URL.String(), l.prefill) {
		panic("a bug on the prefill leg")
	}
	<-r.Context().Done()
	return nil, r.Context().Err()
}

// A panic on the goroutine Baton starts for a prefill leg used to end the whole process. It
// fails that request with 500, counted and logged, and leaves the decode untouched.
func TestPanicOnPrefillLegFailsOneRequest(t *testing.T) {
	p := worker.New(config.Worker{URL: "http://prefill.invalid:1", Role: config.RolePrefill})
	d := worker.New(config.Worker{URL: "http://decode.invalid:1", Role: config.RoleDecode})
	m := metrics.New(worker.NewRegistry(p, d))
	px := &proxy.Proxy{Transport: legTransport{prefill: p.URL}, Timeout: 10 * time.Second, Metrics: m,
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	x := &Parallel{Proxy: px, Metrics: m, Log: px.Log}
	rw := httptest.NewRecorder()
	in := httptest.NewRequest(http.MethodPost, "/generate", strings.NewReader(`{"text":"hi"}`))
	err := x.Execute(rw, in, req("/generate", `{"text":"hi"}`), worker.Pair{Prefill: p, Decode: d})
	x.Wait()
	var f *outcome.Failure
	if !errors.As(err, &f) || f.Answer == nil || f.ClientStatus() != http.StatusInternalServerError || f.Answer.Code != openai.CodeInternalError ||
		f.Verdict().Retryable || f.Verdict().Seam || f.Worker != "" {
		t.Fatalf("Execute = %v, want a final 500 internal_error, no worker's and no pair's fault", err)
	}
	if n := testutil.ToFloat64(m.Panics.WithLabelValues("prefill_leg")); n != 1 {
		t.Errorf("panics counted %v, want 1", n)
	}
	for _, w := range []*worker.Worker{p, d} {
		if ok, failed := w.Outcomes(); ok+failed != 0 || w.InFlight() != 0 {
			t.Errorf("%s: outcomes %d/%d, in flight %d: Baton's bug counted against a worker", w, ok, failed, w.InFlight())
		}
	}
}
