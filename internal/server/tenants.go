package server

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/director"
	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/tenant"
)

// Tenancy is who may call and how much (director.Tenancy).
type Tenancy = director.Tenancy

// tenants returns the tenant set now.
func (s *Server) tenants() *tenant.Set { return s.opts.Tenancy.Set() }

// identify names the request's tenant from its bearer key, or answers it: more than one
// Authorization header is refused (which one would count is ambiguous); a key no tenant has is
// 401, the same answer whatever tenants exist. A tenant's key is Baton's: it is removed from the
// request, so it never reaches a worker. Without keys every request is tenant default — or,
// with a trusted tenant header (smg's --trust-tenant-header), the tenant the header names; where
// tenants have keys the key names the tenant and the header is removed unread, as in smg.
func (s *Server) identify(w http.ResponseWriter, r *http.Request) bool {
	got := r.Header["Authorization"]
	if len(got) > 1 {
		openai.WriteError(w, &openai.Error{Status: http.StatusBadRequest, Code: openai.CodeDuplicateHeader,
			Message: "the request has more than one Authorization header"})
		return false
	}
	set := s.tenants()
	var t *tenant.Tenant
	if h := s.opts.Tenancy.TrustHeader; h != "" && !set.Open() {
		r.Header.Del(h) // a key names its tenant first, as in smg: the header is not asked
	}
	if h := s.opts.Tenancy.TrustHeader; h != "" && set.Open() && len(r.Header.Values(h)) > 0 {
		names := r.Header.Values(h)
		if t = set.ByName(names[0]); len(names) > 1 || t == nil {
			openai.WriteError(w, &openai.Error{Status: http.StatusUnauthorized, Code: openai.CodeInvalidAPIKey,
				Message: fmt.Sprintf("the %s header names no tenant (one header, a configured tenant's name)", h)})
			return false
		}
		r.Header.Del(h)
		r.Header.Del("Authorization")
		recordOf(r).Who = t
		return true
	}
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
	recordOf(r).Who = t
	return true
}

// cutBearer returns the key of "Bearer KEY" (the scheme in any case).
func cutBearer(h string) (string, bool) {
	if len(h) < 7 || !strings.EqualFold(h[:7], "bearer ") {
		return "", false
	}
	return h[7:], true
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
		set(2, "X-Ratelimit-Reset-Requests", director.ResetString(w.Reset))
	}
	if w := d.Tokens; w.Limit > 0 {
		set(3, "X-Ratelimit-Limit-Tokens", strconv.Itoa(w.Limit))
		set(4, "X-Ratelimit-Remaining-Tokens", strconv.Itoa(w.Remaining))
		set(5, "X-Ratelimit-Reset-Tokens", director.ResetString(w.Reset))
	}
}

// serveTenants is GET /tenants: every tenant's limits and its use now.
func (s *Server) serveTenants(w http.ResponseWriter, r *http.Request) {
	views, err := s.d.TenantViews(r.Context())
	out := map[string]any{"tenants": views, "store": "memory"}
	if s.opts.Tenancy.Limiter.Shared() {
		out["store"], out["store_up"] = "redis", err == nil && s.opts.Tenancy.Limiter.StoreUp()
	}
	writeAdmin(w, http.StatusOK, out)
}
