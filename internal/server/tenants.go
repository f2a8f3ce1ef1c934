package server

import (
	"net/http"
	"strconv"
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/baton-llm/baton/internal/metrics"
	"github.com/baton-llm/baton/internal/openai"
)

// identify names the request's tenant from its bearer key, or answers it: more than one
// Authorization header is refused (which one would count is ambiguous); a key no tenant has is
// 401, the same answer whatever tenants exist. A tenant's key is Baton's: it is removed from the
// request, so it never reaches a worker. Without keys every request is tenant default — or,
// with a trusted tenant header (smg's --trust-tenant-header), the tenant the header names; where
// tenants have keys the key names the tenant and the header is removed unread, as in smg.
func (s *Server) identify(w http.ResponseWriter, r *http.Request) bool {
	var trusted []string
	if h := s.d.Tenancy().TrustHeader; h != "" {
		trusted = r.Header.Values(h)
		r.Header.Del(h) // read here or not at all, never passed on
	}
	who, key, e := s.d.Identify(r.Header["Authorization"], trusted)
	if e != nil {
		openai.WriteError(w, e)
		return false
	}
	if key {
		r.Header.Del("Authorization") // Baton's key: it never reaches a worker
	}
	if who != nil {
		recordOf(r).Who = who
	}
	return true
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
