package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/policy"
	"github.com/baton-llm/baton/internal/proxy"
	"github.com/baton-llm/baton/internal/record"
	"github.com/baton-llm/baton/internal/routes"
	"github.com/baton-llm/baton/internal/tenant"
)

// Tenancy is who may call and how much: the tenants (swapped whole by a reload) and the limiter
// that counts their use.
type Tenancy struct {
	// Set returns the tenants now; nil: --api-key's tenant alone (or everyone's, without one).
	Set     func() *tenant.Set
	Limiter *tenant.Limiter
	// MaxTokens is the completion tokens reserved for a request without max_tokens, and the
	// most reserved for one with it.
	MaxTokens int
	// PromptTokens, when set, gives a prompt's token count when the engines' tokenizer answer
	// for it is cached (cache_aware asked for it already); else the prompt is estimated.
	PromptTokens func(model, path string, body []byte) (int, bool)
}

// tenants returns the tenant set now.
func (s *Server) tenants() *tenant.Set { return s.opts.Tenancy.Set() }

// defaultTenancy is the tenancy of a server given none: --api-key names tenant default, and
// without it every request is tenant default; nothing is limited.
func defaultTenancy(apiKey string) Tenancy {
	cfg := config.Default()
	cfg.APIKey = apiKey
	set, err := tenant.Build(cfg, os.Getenv)
	if err != nil {
		panic("server: the default tenants: " + err.Error())
	}
	return Tenancy{Set: func() *tenant.Set { return set }, Limiter: tenant.NewLimiter(nil), MaxTokens: 1024}
}

// identify names the request's tenant from its bearer key, or answers it: more than one
// Authorization header is refused (which one would count is ambiguous); a key no tenant has is
// 401, the same answer whatever tenants exist. A tenant's key is Baton's: it is removed from the
// request, so it never reaches a worker. Without keys every request is tenant default.
func (s *Server) identify(w http.ResponseWriter, r *http.Request) bool {
	got := r.Header["Authorization"]
	if len(got) > 1 {
		openai.WriteError(w, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeDuplicateHeader,
			Message: "the request has more than one Authorization header"})
		return false
	}
	set := s.tenants()
	var t *tenant.Tenant
	if set.Open() {
		if t = set.Identify(""); len(t.Rules()) == 0 && len(t.Models()) == 0 {
			return true // one tenant, unbounded: nothing to name or count (the hot path stays as it was)
		}
	} else {
		var key string
		if len(got) == 1 {
			if k, ok := cutBearer(got[0]); ok {
				key = k
			}
		}
		if t = set.Identify(key); t == nil {
			openai.WriteError(w, &openai.Error{Status: http.StatusUnauthorized, Code: openai.CodeInvalidAPIKey,
				Message: "missing or invalid API key: send 'Authorization: Bearer <key>'"})
			return false
		}
		r.Header.Del("Authorization")
	}
	rec := record.From(r.Context())
	rec.Who, rec.Tenant = t, t.Name
	return true
}

// cutBearer returns the key of "Bearer KEY" (the scheme in any case).
func cutBearer(h string) (string, bool) {
	if len(h) < 7 || !strings.EqualFold(h[:7], "bearer ") {
		return "", false
	}
	return h[7:], true
}

// lease is a request's reservation against its tenant's limits, settled when it ends.
type lease struct {
	l        *tenant.Lease
	estimate int // the prompt tokens it was reserved
}

// admitTenant checks the request against its tenant: a model the tenant may not use is 404
// model_not_found, the answer of a model nobody serves (a tenant cannot learn another's
// models); past a limit it is 429 with Retry-After and nothing is dispatched. An admitted
// request of a limited tenant carries OpenAI's rate-limit headers, and, streamed without usage
// asked for, asks the engine for it (the relay keeps the usage event from the client). The
// lease returned is settled by settleTenant.
func (s *Server) admitTenant(w http.ResponseWriter, r *http.Request, req *openai.Request, path string, est *tokenEstimate) (*lease, bool) {
	rec := record.From(r.Context())
	t := rec.Who
	if t == nil {
		return nil, true
	}
	if !t.Allows(req.Model) {
		proxy.WriteFailure(w, selectionError(&policy.NoWorkerError{Role: config.RoleRegular, Model: req.Model, Unserved: true}))
		return nil, false
	}
	rule := t.Rule(req.Model)
	if rule == nil {
		return nil, true
	}
	prompt, completion := est.get()
	reserved := prompt + completion
	l, d, err := s.opts.Tenancy.Limiter.Reserve(r.Context(), rule, reserved)
	if errors.Is(err, tenant.ErrStoreUnavailable) {
		s.metrics.TenantRejections.WithLabelValues(t.Name, "store_unavailable").Inc()
		openai.WriteError(w, &openai.Error{Status: http.StatusServiceUnavailable, Code: openai.CodeRateLimitStoreUnavailable, RetryAfter: "1",
			Message: "the store that counts tenants' limits cannot be reached; retry shortly"})
		return nil, false
	}
	rateLimitHeaders(w.Header(), d)
	if l == nil {
		s.metrics.TenantRejections.WithLabelValues(t.Name, d.Reason).Inc()
		e := &openai.Error{Status: http.StatusTooManyRequests, Code: openai.CodeTenantRateLimit,
			RetryAfter: strconv.Itoa(int(math.Ceil(max(d.RetryAfter, time.Second).Seconds())))}
		switch d.Reason {
		case tenant.ReasonConcurrency:
			e.Code = openai.CodeTenantConcurrency
			e.Message = fmt.Sprintf("tenant %s has %d requests in flight, its limit (max_concurrent)", t.Name, d.MaxConc)
		case tenant.ReasonRequests:
			e.Message = fmt.Sprintf("tenant %s reached its limit of %d requests per minute", t.Name, d.Requests.Limit)
		default:
			e.Message = fmt.Sprintf("tenant %s reached its limit of %d tokens per minute (this request is reserved about %d)", t.Name, d.Tokens.Limit, reserved)
		}
		openai.WriteError(w, e)
		return nil, false
	}
	if req.Stream {
		rec.CountEvents = true
		if rule.TPM > 0 && routes.Of(path).StreamOptions {
			if body, ok := askUsage(req.Body); ok && req.SetBody(body) == nil {
				rec.StripUsage = true
			}
		}
	}
	return &lease{l: l, estimate: prompt}, true
}

// tokenEstimate is a request's prompt and completion tokens before it is served, worked out the
// first time something needs it (a tenant's limit, a full fleet's queue): the prompt's count
// when the engines' tokenizer answer for it is cached, else its body's bytes / 4; the
// completion's max_tokens (capped) times its prompts and samples.
type tokenEstimate struct {
	s                  *Server
	preq               *pd.Request
	done               bool
	prompt, completion int
}

func (e *tokenEstimate) get() (prompt, completion int) {
	if !e.done {
		req, path := e.preq.Request, e.preq.Path
		e.prompt = (len(req.Body) + 3) / 4
		if f := e.s.opts.Tenancy.PromptTokens; f != nil {
			if n, ok := f(req.Model, path, req.Body); ok {
				e.prompt = n
			}
		}
		e.completion = e.s.completionEstimate(req, path) * max(1, e.preq.Batch) * max(1, e.preq.Samples)
		e.done = true
	}
	return e.prompt, e.completion
}

// completionEstimate is the completion tokens a request is reserved: its max_tokens (or the
// route's spelling of it), at most the configured estimate, which is also what a request
// without one is reserved.
func (s *Server) completionEstimate(req *openai.Request, path string) int {
	limit := s.opts.Tenancy.MaxTokens
	for _, key := range []string{"max_completion_tokens", "max_tokens", "max_output_tokens"} {
		if raw, ok := req.Get(key); ok {
			if n, err := strconv.Atoi(string(bytes.TrimSpace(raw))); err == nil && n >= 0 {
				return min(n, limit)
			}
		}
	}
	if raw, ok := req.Get("sampling_params"); ok && path == "/generate" {
		if v, ok := openai.Get(raw, "max_new_tokens"); ok {
			if n, err := strconv.Atoi(string(bytes.TrimSpace(v))); err == nil && n >= 0 {
				return min(n, limit)
			}
		}
	}
	return limit
}

// askUsage returns body with stream_options.include_usage true, and whether Baton had to set it
// (the client had not asked for usage).
func askUsage(body []byte) ([]byte, bool) {
	opts, ok := openai.Get(body, "stream_options")
	if ok && !bytes.Equal(bytes.TrimSpace(opts), []byte("null")) {
		if v, ok := openai.Get(opts, "include_usage"); ok && bytes.Equal(bytes.TrimSpace(v), []byte("true")) {
			return body, false
		}
		o, err := openai.Set(opts, "include_usage", []byte("true"))
		if err != nil {
			return body, false
		}
		out, err := openai.Set(body, "stream_options", o)
		return out, err == nil
	}
	out, err := openai.Set(body, "stream_options", []byte(`{"include_usage":true}`))
	return out, err == nil
}

// settleTenant settles a request's lease with what it used: the engine's usage when the answer
// carried one; nothing when no answer began (nothing was generated for it); for a stream that
// ended without usage (its client left, or the engine cut it), its prompt estimate and one token
// per token event relayed.
func (s *Server) settleTenant(r *http.Request, ls *lease) {
	rec := record.From(r.Context())
	used := 0
	switch {
	case rec.UsageKnown:
		used = rec.Usage.Prompt + rec.Usage.Completion
	case rec.FirstByte.IsZero():
	default:
		used = ls.estimate + rec.Events
	}
	if ls != nil && ls.l != nil {
		s.opts.Tenancy.Limiter.Settle(ls.l, used)
	}
}

// counterCache keeps the tenant metrics' series of each tenant, model and status, so that a
// request finds its counters with one map read instead of four label lookups. Its keys are
// bounded as the labels are: the configuration's tenants, the metrics' bounded model names, the
// statuses.
type counterCache struct {
	mu sync.RWMutex
	m  map[counterKey]*tenantCounters
}

type counterKey struct {
	tenant, model string
	status        int
}

type tenantCounters struct {
	requests, prompt, completion, cached prometheus.Counter
}

func (c *counterCache) get(m *metrics.Metrics, tenant, model string, status int) *tenantCounters {
	k := counterKey{tenant, model, status}
	c.mu.RLock()
	tc := c.m[k]
	c.mu.RUnlock()
	if tc != nil {
		return tc
	}
	tc = &tenantCounters{requests: m.TenantRequests.WithLabelValues(tenant, model, strconv.Itoa(status)),
		prompt: m.TenantTokens.WithLabelValues(tenant, model, "prompt"), completion: m.TenantTokens.WithLabelValues(tenant, model, "completion"),
		cached: m.TenantTokens.WithLabelValues(tenant, model, "cached")}
	c.mu.Lock()
	if c.m == nil {
		c.m = map[counterKey]*tenantCounters{}
	}
	c.m[k] = tc
	c.mu.Unlock()
	return tc
}

// rateLimitHeaders sets OpenAI's rate-limit headers from d, for the limits the rule has: the
// SDKs back off by them. The names are written canonical, so that setting them costs no
// canonicalisation.
func rateLimitHeaders(h http.Header, d tenant.Decision) {
	if d.Requests.Limit == 0 && d.Tokens.Limit == 0 {
		return
	}
	vals := make([]string, 6) // one backing array for the six values
	set := func(i int, key, v string) { vals[i] = v; h[key] = vals[i : i+1 : i+1] }
	if w := d.Requests; w.Limit > 0 {
		set(0, "X-Ratelimit-Limit-Requests", strconv.Itoa(w.Limit))
		set(1, "X-Ratelimit-Remaining-Requests", strconv.Itoa(w.Remaining))
		set(2, "X-Ratelimit-Reset-Requests", resetString(w.Reset))
	}
	if w := d.Tokens; w.Limit > 0 {
		set(3, "X-Ratelimit-Limit-Tokens", strconv.Itoa(w.Limit))
		set(4, "X-Ratelimit-Remaining-Tokens", strconv.Itoa(w.Remaining))
		set(5, "X-Ratelimit-Reset-Tokens", resetString(w.Reset))
	}
}

// resetString spells a reset as OpenAI does: "1s", "6m0s", "120ms".
func resetString(d time.Duration) string {
	if d < time.Second {
		return strconv.FormatInt(max(0, d.Milliseconds()), 10) + "ms"
	}
	return d.Round(time.Second).String()
}

// TenantView is one tenant in GET /tenants and on the status page: never a key or its hash.
type TenantView struct {
	Name        string     `json:"name"`
	Models      []string   `json:"models"`
	Weight      float64    `json:"weight"`
	MaxPriority string     `json:"max_priority"`
	Rules       []RuleView `json:"limits"`
}

// RuleView is one of a tenant's rules, with its use now.
type RuleView struct {
	Model             string `json:"model,omitempty"`
	RequestsPerMinute int    `json:"requests_per_minute,omitempty"`
	TokensPerMinute   int    `json:"tokens_per_minute,omitempty"`
	MaxConcurrent     int    `json:"max_concurrent,omitempty"`
	// What is left now, and when the bucket is whole again.
	RequestsRemaining *int   `json:"requests_remaining,omitempty"`
	RequestsReset     string `json:"requests_reset,omitempty"`
	TokensRemaining   *int   `json:"tokens_remaining,omitempty"`
	TokensReset       string `json:"tokens_reset,omitempty"`
	InFlight          *int   `json:"in_flight,omitempty"`
	// TokensCharged is what this replica charged the rule since it started, after the engines'
	// usage.
	TokensCharged int64 `json:"tokens_charged"`
}

// TenantViews are the tenants with their limits and use now.
func (s *Server) TenantViews(ctx context.Context) (out []TenantView, storeErr error) {
	out = []TenantView{}
	for _, t := range s.tenants().Tenants() {
		v := TenantView{Name: t.Name, Models: t.Models(), Weight: t.Weight, MaxPriority: t.MaxPriority, Rules: []RuleView{}}
		if v.Models == nil {
			v.Models = []string{}
		}
		for _, r := range t.Rules() {
			d, err := s.opts.Tenancy.Limiter.Peek(ctx, r)
			if err != nil {
				storeErr = err
			}
			rv := RuleView{Model: r.Model, RequestsPerMinute: r.RPM, TokensPerMinute: r.TPM, MaxConcurrent: r.Concurrent,
				TokensCharged: s.opts.Tenancy.Limiter.Charged(r.ID)}
			if r.RPM > 0 {
				rv.RequestsRemaining, rv.RequestsReset = &d.Requests.Remaining, resetString(d.Requests.Reset)
			}
			if r.TPM > 0 {
				rv.TokensRemaining, rv.TokensReset = &d.Tokens.Remaining, resetString(d.Tokens.Reset)
			}
			if r.Concurrent > 0 {
				rv.InFlight = &d.InFlight
			}
			v.Rules = append(v.Rules, rv)
		}
		out = append(out, v)
	}
	return out, storeErr
}

// serveTenants is GET /tenants: every tenant's limits and its use now.
func (s *Server) serveTenants(w http.ResponseWriter, r *http.Request) {
	views, err := s.TenantViews(r.Context())
	out := map[string]any{"tenants": views, "store": "memory"}
	if s.opts.Tenancy.Limiter.Shared() {
		out["store"], out["store_up"] = "redis", err == nil && s.opts.Tenancy.Limiter.StoreUp()
	}
	writeAdmin(w, http.StatusOK, out)
}
