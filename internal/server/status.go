package server

import (
	_ "embed"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/baton-llm/baton/internal/admin"
	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
)

// The status window: the last statusBuckets buckets of statusBucket each (5 minutes).
const (
	statusBucket  = 5 * time.Second
	statusBuckets = 60
	statusSamples = 256 // TTFT samples kept per bucket (reservoir)
	statusErrors  = 20  // recent errors kept
)

// recorder keeps what the status page shows of recent traffic: per bucket the requests, the
// errors and a sample of TTFTs; the last errors. Bounded. (Pairs' handoffs come from their
// counter, baton_pd_pair_handoffs_total.)
type recorder struct {
	mu      sync.Mutex
	buckets [statusBuckets]bucket
	errors  []recentError
}

type bucket struct {
	start            int64 // unix seconds of the bucket's start; 0: empty
	requests, errors int64
	ttft             []float64 // seconds
	seen             int64     // TTFTs offered (for the reservoir)
}

type recentError struct {
	At     time.Time `json:"at"`
	Route  string    `json:"route"`
	Model  string    `json:"model"`
	Status int       `json:"status"`
	Code   string    `json:"code,omitempty"`
	Worker string    `json:"worker,omitempty"`
}

// record takes one finished request; aborted: Baton cut its answer after the head.
func (rc *recorder) record(now time.Time, route, model string, status int, code, worker string, ttft time.Duration, aborted bool) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	b := rc.bucket(now)
	b.requests++
	// An answer Baton cut after its head (its engine failed or stalled mid-stream, the deadline
	// passed) failed its client whatever its status said.
	failed := status >= 500 || status == 0 || aborted
	if aborted && code == "" {
		code = openai.CodeCutMidAnswer
	}
	if failed {
		b.errors++
	}
	if ttft > 0 {
		b.seen++
		if len(b.ttft) < statusSamples {
			b.ttft = append(b.ttft, ttft.Seconds())
		} else if j := rand.Int64N(b.seen); j < statusSamples {
			b.ttft[j] = ttft.Seconds()
		}
	}
	if failed || status == http.StatusTooManyRequests {
		if len(rc.errors) == statusErrors {
			copy(rc.errors, rc.errors[1:])
			rc.errors = rc.errors[:statusErrors-1]
		}
		rc.errors = append(rc.errors, recentError{At: now.UTC().Truncate(time.Millisecond), Route: route, Model: model, Status: status, Code: code, Worker: worker})
	}
}

func (rc *recorder) bucket(now time.Time) *bucket {
	start := now.Unix() / int64(statusBucket/time.Second) * int64(statusBucket/time.Second)
	b := &rc.buckets[(start/int64(statusBucket/time.Second))%statusBuckets]
	if b.start != start {
		*b = bucket{start: start, ttft: b.ttft[:0]}
	}
	return b
}

// statusPoint is one bucket of the page's series.
type statusPoint struct {
	T         int64   `json:"t"`
	RPS       float64 `json:"rps"`
	ErrorRate float64 `json:"error_rate"`
	TTFTp50   float64 `json:"ttft_p50_ms"`
	TTFTp99   float64 `json:"ttft_p99_ms"`
}

// window summarises the last 5 minutes: per-bucket points and the totals over the last minute.
func (rc *recorder) window(now time.Time) (series []statusPoint, lastMinute statusPoint, errs []recentError) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	step := int64(statusBucket / time.Second)
	cur := now.Unix() / step * step
	var minuteTTFT []float64
	var minuteReq, minuteErr int64
	for i := statusBuckets - 1; i >= 0; i-- {
		start := cur - int64(i)*step
		b := &rc.buckets[(start/step)%statusBuckets]
		p := statusPoint{T: start}
		if b.start == start {
			p.RPS = float64(b.requests) / float64(step)
			if b.requests > 0 {
				p.ErrorRate = float64(b.errors) / float64(b.requests)
			}
			p.TTFTp50, p.TTFTp99 = quantileMs(b.ttft, 0.5), quantileMs(b.ttft, 0.99)
			if cur-start < 60 {
				minuteReq, minuteErr = minuteReq+b.requests, minuteErr+b.errors
				minuteTTFT = append(minuteTTFT, b.ttft...)
			}
		}
		series = append(series, p)
	}
	lastMinute = statusPoint{T: cur, RPS: float64(minuteReq) / 60, TTFTp50: quantileMs(minuteTTFT, 0.5), TTFTp99: quantileMs(minuteTTFT, 0.99)}
	if minuteReq > 0 {
		lastMinute.ErrorRate = float64(minuteErr) / float64(minuteReq)
	}
	errs = slices.Clone(rc.errors)
	slices.Reverse(errs)
	return series, lastMinute, errs
}

// pairsOf turns the pairs' handoff counts into the page's rows, busiest first.
func pairsOf(counts map[[2]string]map[string]float64) []pairStatus {
	var pairs []pairStatus
	for k, m := range counts {
		p := pairStatus{Prefill: k[0], Decode: k[1], Handoffs: map[string]int64{}}
		for o, n := range m {
			p.Handoffs[o] = int64(n)
			p.Total += int64(n)
			switch pd.HandoffClass(o) {
			case pd.ClassRecomputed:
				p.Recomputed += int64(n)
			case pd.ClassByDesign:
				p.ByDesign += int64(n)
			case pd.ClassFailed:
				p.Failed += int64(n)
			}
		}
		pairs = append(pairs, p)
	}
	slices.SortFunc(pairs, func(a, b pairStatus) int { return int(b.Total - a.Total) })
	return pairs
}

func quantileMs(v []float64, q float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))] * 1000
}

// A Notice is a condition shown at the top of the status page.
type Notice struct {
	Level string `json:"level"` // warn or bad
	Text  string `json:"text"`
}

// Notices are the conditions the status page shows at its top now.
func (s *Server) Notices() []Notice {
	if s.opts.Notices == nil {
		return nil
	}
	return s.opts.Notices()
}

// pairStatus is a PD pair's handoff outcomes on the status page.
type pairStatus struct {
	Prefill    string           `json:"prefill"`
	Decode     string           `json:"decode"`
	Handoffs   map[string]int64 `json:"handoffs"`
	Total      int64            `json:"total"`
	Recomputed int64            `json:"recomputed"` // a handoff was expected and the decode computed the prompt
	ByDesign   int64            `json:"by_design"`  // no handoff could serve the request (n>1, a batch, a route)
	Failed     int64            `json:"failed"`     // the request failed before its decode answered
}

//go:embed status.html
var statusPage []byte

// StatusHandler serves the status page (GET / and /status) and its data (GET /status.json),
// for the metrics port. With an admin key set, both need it: as a bearer token, or as the
// password of HTTP Basic authentication (what a browser asks for).
func (s *Server) StatusHandler() http.Handler {
	mux := http.NewServeMux()
	page := func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:")
		w.Header().Set("Cache-Control", "no-store")
		_, _ = w.Write(statusPage)
	}
	mux.HandleFunc("GET /{$}", page)
	mux.HandleFunc("GET /status", page)
	mux.HandleFunc("GET /status.json", s.serveStatusJSON)
	mux.HandleFunc("GET /pd/advice", s.servePDAdvice)
	return s.statusAuth(mux)
}

// AdminOnly guards next as the status page is: with an admin key set, only a request carrying
// it passes (pprof on the metrics listener).
func (s *Server) AdminOnly(next http.Handler) http.Handler { return s.statusAuth(next) }

func (s *Server) statusAuth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.admin.Keyed() {
			_, pass, basic := r.BasicAuth()
			if !(basic && s.admin.IsKey(pass)) && !s.admin.KeyOK(r) {
				w.Header().Set("WWW-Authenticate", `Basic realm="baton status", charset="UTF-8"`)
				openai.WriteError(w, &openai.Error{Status: http.StatusUnauthorized, Code: openai.CodeInvalidAPIKey, Message: "the status page, /pd/advice and the profiles need the admin API key (as the password, or 'Authorization: Bearer <admin key>')"})
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

var started = time.Now()

func (s *Server) serveStatusJSON(w http.ResponseWriter, r *http.Request) {
	now := time.Now()
	series, minute, errs := s.status.window(now)
	ws := []admin.WorkerView{}
	for _, wk := range s.d.Registry().Snapshot().Workers {
		ws = append(ws, s.admin.View(wk, now))
	}
	pairs := pairsOf(s.metrics.PairHandoffCounts())
	notices := append([]Notice{}, s.Notices()...)
	queues := s.d.Queues()
	var tenants []director.TenantView
	if !s.d.Tenants().Open() || len(s.d.Tenants().Tenants()[0].Rules()) > 0 {
		tenants, _ = s.d.TenantViews(r.Context())
	}
	var advice any
	if s.d.Advising() {
		advice = s.d.Advice(0, 0, 0)
	}
	body := openai.MarshalJSON(map[string]any{
		"pd_advice": advice,
		"version":   s.opts.Version, "uptime_s": int64(now.Sub(started).Seconds()), "now": now.UTC().Format(time.RFC3339),
		"in_flight": s.InFlight(), "workers": ws, "pairs": pairs, "last_minute": minute, "series": series, "recent_errors": errs,
		"pd": s.d.PD(), "notices": notices, "tenants": tenants, "queues": queues,
		"local_prefill": map[string]any{"threshold": s.d.LocalPrefillThreshold(), "auto": s.d.LocalPrefillAuto(), "served": s.d.LocalPrefills(),
			"serves_whole": s.d.PrefillServesWhole(), "prefill_whole": s.d.PrefillWholes()},
	})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(body)
}
